"""W&B logging: a real offline wandb run, read back from its .wandb files, resumed under the same id."""

import json
import os
from pathlib import Path

import pytest

from orchestration.observability import wandb_logger as wl
from orchestration.observability import wandb_offline
from tests.conftest import REPO, repo_on_path

CONFIG = {
    "model": {"name": "debug_moe", "overrides": {}},
    "precision": {"name": "fp8", "recipe": "rowwise"},
    "logging": {"project": "elastic-fp8", "group": None, "tags": ["sweep1"], "wandb_api_key": "SHOULD-NOT-LEAK"},
    "cluster": {"env_vars": {"HF_TOKEN": "SHOULD-NOT-LEAK", "NCCL_DEBUG": "WARN"}},
    "db_password": "SHOULD-NOT-LEAK",
    "run_name": "unit",
}


def _metrics(steps, precision_at=lambda s: "fp8", world_size=2):
    out = []
    for s in steps:
        out.append({"step": s, "loss": round(5.0 - 0.25 * s, 6), "lr": 1e-3 * (s + 1), "grad_norm": 0.5 + s / 100,
                    "tokens_per_s": 1000.0 + 10 * s, "world_size": world_size, "precision": precision_at(s),
                    "mfu": None if s == 0 else 0.01 * s})
    return out


def _write_jsonl(path: Path, records):
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    # Everything wandb writes goes under tmp_path; no key, no network.
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # anything left in "/tmp" shows here
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # anything written to ~ lands here and is checked
    (tmp_path / "home").mkdir()
    return tmp_path


# ------------------------------------------------------------------------------------------------ pure helpers


def test_scrub_secrets_removes_secret_keys_recursively():
    clean = wl.scrub_secrets(CONFIG)
    assert "SHOULD-NOT-LEAK" not in json.dumps(clean)
    assert clean["cluster"]["env_vars"] == {"NCCL_DEBUG": "WARN"}
    assert clean["logging"]["tags"] == ["sweep1"]
    assert clean["model"] == CONFIG["model"]
    assert "db_password" not in clean
    assert CONFIG["db_password"] == "SHOULD-NOT-LEAK"  # input untouched


@pytest.mark.parametrize(
    "mode, enabled, env, expected",
    [
        ("offline", True, {}, "offline"),
        ("offline", True, {"WANDB_API_KEY": "k"}, "offline"),  # explicit offline stays offline
        ("auto", True, {}, "offline"),  # no key needed by default
        ("auto", True, {"WANDB_API_KEY": "k"}, "online"),
        ("offline", True, {"WANDB_MODE": "online"}, "online"),  # the user's env choice wins
        ("online", True, {"WANDB_MODE": "dryrun"}, "offline"),
        ("online", False, {"WANDB_MODE": "online"}, "disabled"),
        ("disabled", True, {"WANDB_MODE": "online"}, "disabled"),
    ],
)
def test_resolve_mode(mode, enabled, env, expected):
    assert wl.resolve_mode(mode, enabled, env) == expected


def test_resolve_mode_rejects_unknown():
    with pytest.raises(ValueError, match="WANDB_MODE"):
        wl.resolve_mode("offline", True, {"WANDB_MODE": "sometimes"})
    with pytest.raises(ValueError, match="mode"):
        wl.resolve_mode("cloud", True, {})


def test_metrics_row_mapping():
    row = wl.metrics_row(7, {"step": 7, "loss": float("nan"), "precision": "bf16", "mfu": None, "skipped": True,
                             "note": "text", "world_size": 2})
    assert row["step"] == 7 and row["precision_fp8"] == 0.0 and row["skipped"] == 1 and row["world_size"] == 2
    assert row["loss"] != row["loss"]  # NaN kept: a NaN loss must be visible
    assert "mfu" not in row and "note" not in row and "precision" not in row


def test_tags_group_and_alerts():
    assert wl.tags_from_config(CONFIG) == ["model:debug_moe", "precision:fp8", "recipe:rowwise", "sweep1"]
    assert wl.tags_from_config({"precision": {"name": "bf16", "recipe": "rowwise"}}) == ["precision:bf16"]
    assert wl.group_from_config(CONFIG) == "debug_moe"
    assert wl.group_from_config({"logging": {"group": "exp7"}}) == "exp7"
    fallback = {"event": "precision_changed", "step": 40, "from": "fp8", "to": "bf16", "scope": None}
    assert wl.alert_for(fallback)[0] == "FP8 -> BF16 fallback"
    assert wl.alert_for({"event": "rollback", "step": 50, "to_step": 30})[1].startswith("step 50: to_step=30")
    assert wl.alert_for({"event": "checkpoint_saved", "step": 5}) is None
    # every rank writes agreed decisions (worker_rank = writer); "rank" of a divergence is the detecting rank
    counts = wl.count_events([
        dict(fallback, worker_rank=0), dict(fallback, worker_rank=1),
        {"event": "divergence_detected", "rank": 1, "worker_rank": 0},
        {"event": "divergence_detected", "rank": 1, "worker_rank": 1},
        {"event": "divergence_detected", "rank": 0},  # single writer
        {"event": "rollback", "worker_rank": 0}, {"event": "rollback", "worker_rank": 1}])
    assert counts == {"fallbacks": 1, "divergences": 2, "rollbacks": 1}
    assert wl.alert_for(dict(fallback, scope="model"))[1] == "step 40: precision fp8 -> bf16 (whole model)"
    assert wl.alert_for(dict(fallback, scope=["layers.1"]))[1] == "step 40: precision fp8 -> bf16 (['layers.1'])"


def test_run_id_created_once(tmp_path):
    first = wl.read_or_create_run_id(tmp_path)
    assert first == wl.read_or_create_run_id(tmp_path) == (tmp_path / wl.RUN_ID_FILE).read_text().strip()
    assert len(first) == 8 and first.isalnum()
    assert sorted(p.name for p in tmp_path.iterdir()) == [wl.RUN_ID_FILE]  # no temp file left


def test_disabled_run_is_noop(tmp_path):
    run = wl.WandbRun(tmp_path / "rd", CONFIG, project="p", group=None, tags=[], mode="disabled")
    run.log_metrics(0, {"loss": 1.0})
    run.log_event({"event": "rollback", "step": 0})
    run.finish({"status": "completed"})
    assert run.run is None and not (tmp_path / "rd").exists()


# ------------------------------------------------------------------------------------------------ real offline run


def test_offline_run_logs_metrics_and_resumes_same_id(wandb_env):
    run_dir = wandb_env / "run"
    run_dir.mkdir()
    # segment 1: steps 0..5 in fp8, then a fallback at step 5
    seg1 = _metrics(range(6))
    events1 = [{"time": 1.0, "event": "run_start", "step": 0},
               {"time": 2.0, "event": "worker_group_start", "step": 0, "world_size": 2, "grad_accum": 2},
               {"time": 3.0, "event": "divergence_detected", "step": 5, "rank": 1, "detector": "loss_spike",
                "value": 9.0, "threshold": 4.0},
               {"time": 3.5, "event": "precision_changed", "step": 5, "from": "fp8", "to": "bf16", "scope": None}]
    _write_jsonl(run_dir / "metrics.jsonl", seg1)
    _write_jsonl(run_dir / "events.jsonl", events1)

    tags = wl.tags_from_config(CONFIG)
    run = wl.WandbRun(run_dir, CONFIG, project="elastic-fp8-test", group="exp-a", tags=tags, system_metrics=False)
    assert run.mode == "offline" and run.run is not None
    run_id = run.run_id
    for rec in seg1:
        run.log_metrics(rec["step"], rec)
    for ev in events1:
        run.log_event(ev)
    run.log_event({"time": 4.0, "event": "profile", "step": 5, "from_step": 2, "steps": 3, "started_time": 3.8,
                   "wall_ms_per_step": 114.3, "ms_per_step": {"gemm": 46.4, "fp8_cast_amax": 14.5, "idle": 4.5}})
    run.finish({"status": "stopped_divergence", "final_loss": seg1[-1]["loss"], "fallbacks": 1})

    got = wandb_offline.read_offline_run(run_dir)
    assert got.run_id == run_id and len(got.segments) == 1
    rows = [r for r in got.history if "loss" in r]
    assert [r["step"] for r in rows] == [m["step"] for m in seg1]
    for r, m in zip(rows, seg1):
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "world_size"):
            assert r[key] == pytest.approx(m[key], rel=0, abs=0), key
        assert r["precision_fp8"] == 1.0
        assert r.get("mfu") == m["mfu"]
    assert got.tags == tags and got.group == "exp-a" and got.project == "elastic-fp8-test"
    assert got.config["model"] == {"name": "debug_moe", "overrides": {}}
    assert "SHOULD-NOT-LEAK" not in json.dumps(got.config) and "db_password" not in got.config
    assert got.summary["final_loss"] == seg1[-1]["loss"] and got.summary["fallbacks"] == 1
    # counts seeded from events.jsonl (written before the run started): 1 divergence, 1 fallback
    assert got.summary["events/fallbacks"] == 1 and got.summary["events/divergences"] == 1
    # the profiled window, one value per category
    assert {k: v for k, v in got.summary.items() if k.startswith("profile/")} == {
        "profile/wall_ms": 114.3, "profile/gemm_ms": 46.4, "profile/fp8_cast_amax_ms": 14.5, "profile/idle_ms": 4.5}
    assert got.alerts == []  # alerts only online
    # the events table holds every events.jsonl record
    tables = list((got.segments[0].parent / "files" / "media" / "table").glob("events_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == wl.EVENT_TABLE_COLUMNS
    assert [row[1] for row in table["data"]] == [e["event"] for e in events1]

    # segment 2: a restart (same run_dir) rolls back to step 3 and continues in bf16 on 1 worker
    seg2 = _metrics(range(4, 9), precision_at=lambda s: "bf16", world_size=1)
    events2 = [{"time": 10.0, "event": "rollback", "step": 5, "to_step": 3, "skipped_samples": 16},
               {"time": 11.0, "event": "resume", "step": 3, "from_step": 3, "world_size": 1}]
    _write_jsonl(run_dir / "metrics.jsonl", seg2)
    _write_jsonl(run_dir / "events.jsonl", events2)
    run2 = wl.WandbRun(run_dir, CONFIG, project="elastic-fp8-test", group="exp-a", tags=tags, system_metrics=False)
    assert run2.run_id == run_id
    for rec in seg2:
        run2.log_metrics(rec["step"], rec)
    run2.log_event({"time": 1e12, "event": "rollback", "step": 8, "to_step": 6, "skipped_samples": 4})
    run2.finish({"status": "completed", "final_loss": seg2[-1]["loss"]})

    got2 = wandb_offline.read_offline_run(run_dir)
    assert got2.run_id == run_id and len(got2.segments) == 2
    assert got2.segments[0] == got.segments[0]  # the first segment is untouched
    rows = [r for r in got2.history if "loss" in r]
    logged = seg1 + seg2
    assert [r["step"] for r in rows] == [m["step"] for m in logged]  # later steps appended after the first ones
    assert [r["loss"] for r in rows] == [m["loss"] for m in logged]
    assert [r["precision_fp8"] for r in rows] == [1.0] * 6 + [0.0] * 5
    assert [r["world_size"] for r in rows] == [2] * 6 + [1] * 5
    # running counts continue across the restart: rollback 1 (from events.jsonl) then 2 (logged live)
    assert [r["events/rollbacks"] for r in got2.history if "events/rollbacks" in r] == [2]
    assert got2.summary["events/rollbacks"] == 2 and got2.summary["events/fallbacks"] == 1
    assert got2.summary["final_loss"] == seg2[-1]["loss"]
    assert wandb_offline.read_offline_history(run_dir) == got2.history
    assert wl.sync_command(run_dir, run_id) == f"wandb sync --id {run_id} {run_dir}/wandb/offline-run-*-{run_id}"

    # nothing written to ~ (HOME is tmp_path/home here), no temp files left outside the run directory
    assert list((wandb_env / "home").rglob("*")) == []
    assert list((wandb_env / "tmp").rglob("*")) == []


def test_default_dirs_land_in_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, "")  # unset by the user (monkeypatch restores it afterwards)
    run_dir = tmp_path / "run"
    run = wl.WandbRun(run_dir, {}, project="p", group=None, tags=[], system_metrics=False)
    run.log_metrics(0, {"loss": 1.5})
    run.finish({})
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        assert Path(os.environ[var]).is_relative_to(run_dir), var
    assert [r["loss"] for r in wandb_offline.read_offline_history(run_dir) if "loss" in r] == [1.5]
    assert not (tmp_path / "home").exists() or list((tmp_path / "home").rglob("*")) == []


def test_reader_rejects_non_wandb_file(tmp_path):
    bad = tmp_path / "x.wandb"
    bad.write_bytes(b"not a log at all")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        list(wandb_offline.iter_record_payloads(bad))
    with pytest.raises(ValueError, match="wandb_run_id"):
        wandb_offline.read_offline_run(tmp_path)


KILLED_SEGMENT = r"""
import json, os, signal, sys, time
from pathlib import Path
from orchestration.observability.events import RunDir
from orchestration.observability.wandb_logger import WandbRun
run_dir = Path(sys.argv[1])
rd = RunDir(run_dir)
run = WandbRun(run_dir, {}, project="p", group=None, tags=[], system_metrics=False)
print(run.run_id, flush=True)
for step in range(10):
    record = {"step": step, "loss": 4.0 - 0.125 * step, "tokens_per_s": 900.0 + step, "world_size": 2,
              "precision": "fp8", "time": time.time()}
    rd.metrics(record)  # the worker writes metrics.jsonl, then logs the same record to W&B
    run.log_metrics(step, record)
os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-run: no finish(), wandb-core dies unflushed
"""


def test_restart_after_kill_backfills_from_metrics_jsonl(wandb_env):
    import subprocess
    import sys
    import time

    from orchestration.observability.events import RunDir

    run_dir = wandb_env / "run"
    proc = subprocess.run([sys.executable, "-c", KILLED_SEGMENT, str(run_dir)], cwd=REPO, capture_output=True,
                          check=False, text=True, timeout=60,
                          # WANDB_SERVICE would make the child share this process's wandb-core, which then
                          # keeps the killed child's stream open ("run ID in use"); Ray workers do not share it.
                          env={**{k: v for k, v in repo_on_path().items() if k != "WANDB_SERVICE"},
                               "TMPDIR": str(wandb_env / "tmp")})
    assert proc.returncode == -9, proc.stderr
    assert list((wandb_env / "tmp").iterdir()) == []  # wandb's import-time temp dirs went into the run dir
    run_id = proc.stdout.split()[0]
    time.sleep(0.2)  # let the orphaned wandb-core notice its parent died

    run = wl.WandbRun(run_dir, {}, project="p", group=None, tags=[], system_metrics=False)
    assert run.run_id == run_id
    rd = RunDir(run_dir)
    for step in range(10, 13):
        record = {"step": step, "loss": 4.0 - 0.125 * step, "tokens_per_s": 900.0 + step, "world_size": 1,
                  "precision": "bf16", "time": time.time()}
        rd.metrics(record)
        run.log_metrics(step, record)
    run.finish({"status": "completed"})

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in wandb_offline.read_offline_history(run_dir) if "loss" in r]
    # every metrics.jsonl record exactly once, in order, whatever the killed segment had flushed
    assert [r["step"] for r in rows] == list(range(13)) == [m["step"] for m in metrics]
    assert [r["loss"] for r in rows] == [m["loss"] for m in metrics]
    assert [r["time"] for r in rows] == [m["time"] for m in metrics]
    assert [r["precision_fp8"] for r in rows] == [1.0] * 10 + [0.0] * 3


def test_wait_until_flushed_treats_a_torn_file_as_not_flushed(tmp_path):
    """A .wandb file shorter than its header (caught mid-write) is 'not flushed yet', not a crash at run end."""
    from orchestration.observability.wandb_offline import wait_until_flushed

    torn = tmp_path / "run.wandb"
    torn.write_bytes(b":W&")
    assert wait_until_flushed(torn, timeout_s=0.2) is False
