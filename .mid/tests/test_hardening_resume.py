"""Resuming a run whose directory is not as it was left: every checkpoint corrupt, checkpoint.resume=false over a
run, a data source without files, changed model settings with config.yaml gone. Each case is refused before
training starts (most before Ray starts), names what is wrong and what to do, and changes nothing on disk.

One real run (torchrun launcher, one process, no Ray: ~15 s) saves steps 0, 5 and 10; each test works on a copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestration.observability.events import read_jsonl
from tests.conftest import REPO, launch, launch_env

pytestmark = pytest.mark.slow

RUN = "saved"
SETTINGS = ["model=debug_dense", "logging.wandb=false", "logging.ray_metrics=false", "train.log_every=1",
            "checkpoint.every_steps=5", "train.warmup_steps=2"]


def torchrun(env: dict, run_root: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The worker loop in one local process (orchestration.driver.torchrun under torch.distributed.run)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           "-m", "orchestration.driver.torchrun", f"run_root={run_root}", f"run_name={RUN}",
                           *SETTINGS, *overrides], check=False, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved_root")
    proc = torchrun(launch_env(root), root, "train.steps=10")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = sorted(p.name for p in (root / RUN / "checkpoints").iterdir())
    assert steps == ["step_000000", "step_000005", "step_000010"], steps
    return root


@pytest.fixture
def run_copy(saved_run, tmp_path) -> Path:
    """A private copy of the saved run's root; returns the run root."""
    root = tmp_path / "root"
    shutil.copytree(saved_run, root)
    return root


def _snapshot(run_dir: Path) -> list:
    return sorted((str(p.relative_to(run_dir)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in run_dir.rglob("*") if p.is_file())


def _shards(checkpoint: Path) -> list[Path]:
    return sorted((checkpoint / "dcp").glob("*.distcp"))


def test_resume_false_over_a_run_names_its_newest_checkpoint(run_copy, isolated_env):
    before = _snapshot(run_copy / RUN)
    proc = launch(isolated_env, f"run_root={run_copy}", f"run_name={RUN}", *SETTINGS, "checkpoint.resume=false",
                  timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step_000010 the newest" in proc.stderr, proc.stderr
    assert "Ray dashboard" not in proc.stdout
    assert _snapshot(run_copy / RUN) == before


def test_every_checkpoint_damaged_is_refused_before_ray_starts(run_copy, isolated_env):
    """Truncated shards in all three checkpoints: no start from step 0 in the same directory, no Ray; the message
    lists each checkpoint with its reason and the two ways forward."""
    checkpoints = run_copy / RUN / "checkpoints"
    for step_dir in checkpoints.iterdir():
        shard = _shards(step_dir)[0]
        shard.write_bytes(shard.read_bytes()[:-7])
    before = _snapshot(run_copy / RUN)
    proc = launch(isolated_env, f"run_root={run_copy}", f"run_name={RUN}", *SETTINGS, "train.steps=20", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in ("step_000000", "step_000005", "step_000010"):
        assert f"{name}: size mismatch" in proc.stderr, proc.stderr
    assert "checkpoint.resume=false" in proc.stderr and "run_name" in proc.stderr
    assert "Ray dashboard" not in proc.stdout
    assert _snapshot(run_copy / RUN) == before


def test_every_checkpoint_corrupt_is_refused_at_start_and_resume_false_starts_over(run_copy, isolated_env):
    """A flipped byte in a shard of each checkpoint (sizes intact, so only the digests tell): the start checks hash
    the checkpoints and refuse before training and before any file of the run changes (the completed run's summary
    stays); checkpoint.resume=false then starts the run over in the same directory, and the corrupt checkpoints
    never count for retention."""
    checkpoints = run_copy / RUN / "checkpoints"
    for step_dir in checkpoints.iterdir():
        shard = _shards(step_dir)[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = {p.name: _snapshot(p) for p in checkpoints.iterdir()}
    refused = torchrun(isolated_env, run_copy, "train.steps=20")
    assert refused.returncode != 0, refused.stdout[-2000:]
    out = refused.stdout + refused.stderr
    for name in ("step_000000", "step_000005", "step_000010"):
        assert f"{name}: sha256 mismatch" in out, out[-4000:]
    assert "checkpoint.resume=false" in out and "run_name" in out
    assert {p.name: _snapshot(p) for p in checkpoints.iterdir()} == before  # nothing saved over them
    summary = json.loads((run_copy / RUN / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == 10  # the saved run's record, untouched

    # Starting over: steps 0 and 5 replace the corrupt ones of the same name; the corrupt step 10 stays (never read,
    # never counted: keep_last=1 must keep the new step 5, not the corrupt step 10).
    over = torchrun(isolated_env, run_copy, "train.steps=5", "checkpoint.resume=false", "checkpoint.keep_last=1",
                    "checkpoint.keep_good=1")
    assert over.returncode == 0, over.stdout[-3000:] + over.stderr[-3000:]
    from orchestration.checkpoint.directory import verify_checkpoint

    assert verify_checkpoint(checkpoints / "step_000005").step == 5
    assert (checkpoints / "step_000010").is_dir()
    events = read_jsonl(run_copy / RUN / "events.jsonl")
    assert not [e for e in events if e["event"] == "checkpoint_deleted" and e["step"] == 5]


def test_changed_model_settings_with_config_yaml_missing_are_refused_from_the_checkpoint(run_copy, isolated_env):
    """config.yaml deleted: the check reads the settings the newest checkpoint was saved with, refuses the changed
    model before Ray starts, and does not write config.yaml; the right settings then resume."""
    run_dir = run_copy / RUN
    (run_dir / "config.yaml").unlink()
    proc = launch(isolated_env, f"run_root={run_copy}", f"run_name={RUN}", *SETTINGS, "+model.overrides.n_layers=1",
                  "train.steps=20", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model.overrides (saved {}, now {'n_layers': 1})" in proc.stderr, proc.stderr
    assert "Ray dashboard" not in proc.stdout
    assert not (run_dir / "config.yaml").exists()

    resumed = torchrun(isolated_env, run_copy, "train.steps=12")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    resumes = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert [e["from_step"] for e in resumes] == [10]


def test_data_source_without_files_is_refused_before_ray_starts(tmp_path, isolated_env):
    empty = tmp_path / "corpus"
    empty.mkdir()
    (empty / "notes.bin").write_bytes(b"not text")
    proc = launch(isolated_env, f"run_root={tmp_path / 'runs'}", "run_name=nodata", *SETTINGS,
                  f"data.source={empty}", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.source" in proc.stderr and str(empty) in proc.stderr, proc.stderr
    assert "Ray dashboard" not in proc.stdout
    assert not (tmp_path / "runs" / "nodata").exists()


def test_fp8_fallback_counts_its_skipped_step(tmp_path, isolated_env):
    """An FP8 overflow on the only rank at step 30: the fallback to BF16 drops that step's update, and the summary
    and the final table count it (skipped_steps said 0 while skipped_ranges held the step's samples)."""
    proc = torchrun(isolated_env, tmp_path, "train.steps=40", "faults=fp8_overflow", "faults.rank=0",
                    "faults.step=30", "monitor.cooldown_steps=5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / RUN / "summary.json").read_text())
    assert summary["fallbacks"] == 1
    assert summary["skipped_ranges"] == [[30 * 16, 31 * 16]], summary["skipped_ranges"]
    assert summary["skipped_steps"] == 1
    assert any(line.split() == ["skipped", "steps", "1"] for line in proc.stdout.splitlines()), proc.stdout[-2000:]


def _digests(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_every_refused_start_changes_no_file_of_the_run(run_copy, isolated_env, tmp_path):
    """Each way a start of a completed run is refused - changed settings, a token shard that changed, checkpoints
    whose digests fail (sizes intact), a run another start holds - exits 2 and leaves every file of the run
    directory byte for byte as it was (summary.json and final_state.json of the completed run included)."""
    from tests.test_run_lock import hold

    run_dir = run_copy / RUN
    base = [f"run_root={run_copy}", f"run_name={RUN}", *SETTINGS]
    before = _digests(run_dir)
    assert {"summary.json", "final_state.json", "config.yaml", "events.jsonl"} <= before.keys()

    def refused(*overrides: str, says: str) -> None:
        proc = launch(isolated_env, *base, *overrides, timeout=120)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert says in proc.stderr, proc.stderr[-2000:]
        assert "Ray dashboard" not in proc.stdout
        assert _digests(run_dir) == before, f"refused start ({says}) changed the run directory"

    refused("model=debug_moe", says="model.name (saved 'debug_dense', now 'debug_moe')")

    corpus = tmp_path / "corpus"
    stdlib = Path(json.__file__).parent.parent
    prep = subprocess.run([sys.executable, "-m", "orchestration.data.prepare", "--input", str(stdlib / "json"),
                           str(stdlib / "email"), "--tokenizer", "bytes", "--out", str(corpus),
                           "--val-fraction", "0.1", "--workers", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert prep.returncode == 0, prep.stderr
    shard = corpus / "train_00000.bin"
    data = bytearray(shard.read_bytes())
    data[100:200] = bytes(100)
    shard.write_bytes(bytes(data))
    refused("data=tokenized", f"data.path={corpus}", says=f"shard {shard} has sha256 ")

    for step_dir in (run_dir / "checkpoints").iterdir():
        dcp_shard = _shards(step_dir)[0]
        flipped = bytearray(dcp_shard.read_bytes())
        flipped[len(flipped) // 2] ^= 0xFF
        dcp_shard.write_bytes(bytes(flipped))
    before = _digests(run_dir)
    refused("train.steps=20", says="every checkpoint in")

    holder = hold(run_dir, heartbeat_s=600.0)  # no heartbeat rewrites its run.lock during the check
    try:
        before = _digests(run_dir)  # with the holder's run.lock
        refused("checkpoint.resume=false", says="is being written by another start")
    finally:
        holder.kill()
        holder.wait(timeout=10)
