"""The default job end to end on a real local Ray cluster, and resume by run name. Slow: a few minutes."""

import json

import pytest
import yaml

from orchestration.observability.events import read_jsonl
from tests.conftest import launch

pytestmark = pytest.mark.slow

REQUIRED_METRICS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "world_size", "precision", "mfu"}


def test_default_job_end_to_end(tmp_path, isolated_env, no_ray_leftovers):
    proc = launch(isolated_env, f"run_root={tmp_path / 'runs'}", "run_name=default")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "default"
    assert f"Run directory: {run_dir}" in proc.stdout
    assert "[progress]" in proc.stdout and proc.stdout.count("[progress]") < 60  # visible, not flooding

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["name"] == "debug_moe" and config["precision"]["name"] == "fp8"

    events = read_jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    for name in ("run_start", "worker_group_start", "checkpoint_saved", "run_end"):
        assert name in names, name
    assert all({"time", "event", "step"} <= set(e) for e in events)
    # The machine's decisions and the FP8 layer count, printed before the run starts and kept in run_start.
    run_start = next(e for e in events if e["event"] == "run_start")
    assert run_start["machine"][0].startswith("cluster: 2 CPU workers of 8 GiB (the CPU demo)"), run_start
    layers = run_start["fp8_layers"]
    assert layers["converted"] == layers["eligible"] > 0 and not layers["kept_bf16"]  # CPU emulates every layer
    for line in (run_start["machine"][0], f"fp8: {layers['converted']} of {layers['eligible']} layers"):
        assert line in proc.stdout and proc.stdout.index(line) < proc.stdout.index("Run directory:"), proc.stdout[:2000]
    start = next(e for e in events if e["event"] == "worker_group_start")
    assert start["world_size"] == 2 and start["grad_accum"] == 2  # 16 sequences / (2 workers x micro 4)

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics and all(REQUIRED_METRICS <= set(m) for m in metrics)
    steps = [m["step"] for m in metrics]
    assert steps == sorted(set(steps)) and steps[-1] == config["train"]["steps"]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_step"] == config["train"]["steps"]
    # Byte-level loss starts near ln(256) = 5.55; the debug MoE must learn real structure, not just byte frequencies.
    assert summary["first_loss"] > 4.0
    assert summary["final_loss"] < summary["first_loss"] - 1.5, summary
    assert summary["world_sizes_seen"] == [2]
    assert summary["samples_consumed"] == config["train"]["steps"] * config["train"]["global_batch_size"]
    assert summary["consumed_ranges"] == [[0, summary["samples_consumed"]]]
    assert "final loss" in proc.stdout  # the summary table
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "W&B offline run missing"


def test_resume_same_run_name_repeats_no_step(tmp_path, isolated_env, no_ray_leftovers):
    common = [f"run_root={tmp_path / 'runs'}", "run_name=resumed", "model=debug_dense", "checkpoint.every_steps=5",
              "train.log_every=1", "train.warmup_steps=2"]
    # The first start saves steps 0 and 5 in the background (checkpoint.async_save=always; default auto is on for
    # cuda only): reported to Ray when they finish, then resumed from step 10 like the synchronous saves.
    first = launch(isolated_env, *common, "train.steps=10", "checkpoint.async_save=always")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = launch(isolated_env, *common, "train.steps=15")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    run_dir = tmp_path / "runs" / "resumed"
    events = read_jsonl(run_dir / "events.jsonl")
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes and resumes[-1]["from_step"] == 10 and resumes[-1]["world_size"] == 2
    background = [e for e in events if e["event"] == "checkpoint_timing" and e.get("background")]
    assert [e["checkpoint_step"] for e in background] == [0, 5]
    assert all(e["seconds"] < e["background_s"] and e["write_s"] > 0 for e in background)
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 16)), steps  # every step once, none repeated
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 15 and summary["consumed_ranges"] == [[0, 15 * 16]]

    # One W&B run across both starts: the same id resumed, its offline history equal to metrics.jsonl.
    from orchestration.observability.wandb_offline import offline_segments, read_offline_history

    assert len(offline_segments(run_dir)) == 2
    metrics = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}
    history = [row for row in read_offline_history(run_dir) if "loss" in row]
    assert [row["step"] for row in history] == list(range(1, 16))
    for row in history:
        assert row["loss"] == pytest.approx(metrics[row["step"]]["loss"], rel=1e-6)

    # A third start with another model under the same name: refused by the launcher before Ray starts and before
    # anything in the run directory changes (config.yaml, summary, checkpoints all as they were).
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file())
    third = launch(isolated_env, *[c for c in common if c != "model=debug_dense"], "model=debug_moe",
                   "train.steps=20", timeout=120)
    assert third.returncode == 2, third.stdout[-3000:] + third.stderr[-3000:]
    assert "model.name (saved 'debug_dense', now 'debug_moe')" in third.stderr
    assert "Ray dashboard" not in third.stdout
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()) == before


def test_same_worker_loop_under_torchrun_without_ray(tmp_path, isolated_env):
    """The launcher the multi-GPU machines use (they cannot carry Ray): 2 processes, gloo, FSDP2, fp8."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "orchestration.driver.torchrun", f"run_root={tmp_path}", "run_name=tr", "model=debug_moe",
                           "train.steps=30", "logging.wandb=false", "logging.ray_metrics=false",
                           "checkpoint.every_steps=10", "checkpoint.async_save=always"], check=False,
                          cwd=REPO, env=isolated_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Our INFO diagnostics reach stderr as under launch.py (the launcher sets up logging; here each rank's FSDP setup).
    assert proc.stderr.count("INFO orchestration.training.distributed: FSDP2 all-gathers") == 2, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "tr" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == 30
    assert summary["world_sizes_seen"] == [2]
    assert summary["consumed_ranges"] == [[0, 30 * 16]]
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    # Steps 0, 10 and 20 saved in the background by both ranks (a gloo group of their own), step 30 synchronously;
    # step 0, good by definition, marked good once written.
    from orchestration.checkpoint.directory import verify_checkpoint

    events = read_jsonl(tmp_path / "tr" / "events.jsonl")
    timing = [e for e in events if e["event"] == "checkpoint_timing"]
    assert [(e.get("checkpoint_step", e["step"]), bool(e.get("background"))) for e in timing] == [
        (0, True), (10, True), (20, True), (30, False)]
    assert [e["step"] for e in events if e["event"] == "checkpoint_good"][:1] == [0]
    checkpoints = sorted((tmp_path / "tr").rglob("step_0000[123]0"))
    assert [verify_checkpoint(p).step for p in checkpoints] == [10, 20, 30]


def test_torchrun_without_a_run_id_or_name_is_refused(tmp_path, isolated_env):
    """torchrun without --standalone/--rdzv-id sets TORCHELASTIC_RUN_ID=none: every such launch would share
    runs/none (and resume one another). Refused before anything is written, naming run_name."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "orchestration.driver.torchrun", f"run_root={tmp_path}", "model=debug_dense",
                           "logging.wandb=false"], check=False, cwd=REPO,
                          env={**isolated_env, "TORCHELASTIC_RUN_ID": "none"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pass run_name=NAME" in proc.stderr
    assert not list(tmp_path.iterdir())
