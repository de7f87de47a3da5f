"""Fault injection from config in real 2-worker Ray runs: each fault drives its expected path, agreed by both
workers at the same step, and the run still ends with a finite, falling loss."""

import json
import math

import pytest

from orchestration.observability.events import read_jsonl
from tests.conftest import launch

pytestmark = pytest.mark.slow

STEPS = 60
BATCH = 8
COMMON = ["model=debug_dense", "precision=fp8", f"train.steps={STEPS}", f"train.global_batch_size={BATCH}",
          "data.seq_len=64", "train.log_every=1", "checkpoint.every_steps=10", "monitor.good_after_steps=5",
          "logging.progress_every_s=10"]


def run_fault(tmp_path, env, name, *overrides):
    proc = launch(env, *COMMON, f"run_root={tmp_path}", f"run_name={name}", *overrides, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / name
    events = read_jsonl(run_dir / "events.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < summary["first_loss"] - 1.0
    assert all(m["loss"] is not None and math.isfinite(m["loss"]) for m in metrics if m["step"] > 35)
    return events, summary, metrics


def on_both_workers(events, name, step=None):
    """The event as written by each worker; asserts both workers wrote it at the same step."""
    hits = [e for e in events if e["event"] == name and (step is None or e["step"] == step)]
    by_worker = {e["worker_rank"]: e for e in hits}
    assert set(by_worker) == {0, 1}, (name, hits)
    assert by_worker[0]["step"] == by_worker[1]["step"]
    return by_worker[0]


def test_nan_grad_on_one_rank_skips_the_step_on_both(tmp_path, isolated_env):
    events, summary, _ = run_fault(tmp_path, isolated_env, "nan", "faults=nan_grad", "faults.rank=1",
                                   "faults.step=30")
    detected = on_both_workers(events, "divergence_detected", step=30)
    assert detected["detector"] == "nonfinite_grad" and detected["rank"] == 1
    on_both_workers(events, "step_skipped", step=30)
    assert not [e for e in events if e["event"] in ("precision_changed", "rollback")]
    assert summary["skipped_steps"] == 1 and summary["fallbacks"] == 0 and summary["rollbacks"] == 0
    # The skipped step's samples are dropped, every other sample consumed once.
    assert summary["skipped_ranges"] == [[30 * BATCH, 31 * BATCH]]
    assert summary["consumed_ranges"] == [[0, 30 * BATCH], [31 * BATCH, STEPS * BATCH]]


def test_persistent_loss_spike_skips_falls_back_then_rolls_back(tmp_path, isolated_env):
    events, summary, metrics = run_fault(tmp_path, isolated_env, "spike", "faults=loss_spike", "faults.rank=0",
                                         "faults.step=30", "faults.num_steps=3")
    assert on_both_workers(events, "divergence_detected", step=30)["detector"] == "loss_spike"
    on_both_workers(events, "step_skipped", step=30)
    change = on_both_workers(events, "precision_changed", step=31)
    assert (change["from"], change["to"], change["scope"]) == ("fp8", "bf16", "model")
    rollback = on_both_workers(events, "rollback")
    # Newest good checkpoint before the spike: step 20 (the step-30 one never passed 5 clean steps).
    assert rollback["to_step"] == 20 and rollback["from_step"] == 32
    assert rollback["skipped_samples"] == (33 - 20) * BATCH
    assert summary["rollbacks"] == 1 and summary["fallbacks"] == 1
    # PaLM-style: the data window that led to the spike is skipped, never replayed.
    assert summary["skipped_ranges"] == [[20 * BATCH, 33 * BATCH]]
    assert summary["samples_consumed"] == STEPS * BATCH
    assert [m["precision"] for m in metrics if m["step"] > 32] == ["bf16"] * len([m for m in metrics
                                                                               if m["step"] > 32])


def test_fp8_overflow_falls_back_to_bf16_then_retries_fp8(tmp_path, isolated_env):
    events, summary, metrics = run_fault(tmp_path, isolated_env, "overflow", "faults=fp8_overflow",
                                         "faults.rank=1", "faults.step=30", "monitor.cooldown_steps=15")
    detected = on_both_workers(events, "divergence_detected", step=30)
    assert detected["detector"].startswith("fp8_") and detected["rank"] == 1
    down = on_both_workers(events, "precision_changed", step=30)
    assert (down["from"], down["to"]) == ("fp8", "bf16")
    up = on_both_workers(events, "precision_changed", step=45)
    assert (up["from"], up["to"]) == ("bf16", "fp8")
    assert summary["fallbacks"] == 1 and summary["rollbacks"] == 0
    precision_at = {m["step"]: m["precision"] for m in metrics}
    assert precision_at[35] == "bf16" and precision_at[STEPS] == "fp8"
