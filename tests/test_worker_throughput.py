"""benchmarks/worker_throughput.py's reading of a run directory: the numbers its tables report."""

from __future__ import annotations

import json

from benchmarks.worker_throughput import summarize_run


def _write(run_dir, metrics, events, summary):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_summary_of_a_run_directory(tmp_path):
    metrics = [{"step": s, "loss": 10.0 / s, "tokens_per_s": tps, "step_time_s": 8192 / tps, "mfu": tps / 1e5,
                "gpu_mem_peak_gib": 30.0 + s / 10, "time": 1000.0 + 50 + s}
               for s, tps in [(2, 500.0), (4, 60000.0), (6, 62000.0), (8, 64000.0), (10, 61000.0)]]
    events = [{"time": 1000.0, "event": "run_start", "step": 0},
              {"time": 1004.5, "event": "worker_group_start", "step": 0, "recipe": "tensorwise"},
              {"time": 1030.0, "event": "checkpoint_good", "step": 0},
              {"time": 1030.0, "event": "checkpoint_timing", "step": 0, "seconds": 25.5},
              {"time": 1056.0, "event": "precision_changed", "step": 6, "from": "fp8", "to": "bf16"},
              {"time": 1070.0, "event": "checkpoint_timing", "step": 10, "seconds": 21.0, "write_s": 15.0,
               "hash_s": 4.0}]
    _write(tmp_path / "r", metrics, events, {"status": "completed", "final_step": 10})
    out = summarize_run(tmp_path / "r", skip_steps=4)
    # steps 6, 8, 10 are past the warm-up: median of 62000, 64000, 61000
    assert out["tokens_per_s_median"] == 62000.0 and out["steady_log_lines"] == 3
    assert out["mfu_median"] == 0.62 and out["step_time_s_median"] == 8192 / 62000
    assert out["gpu_mem_peak_gib"] == 31.0
    assert out["setup_s"] == 4.5 and out["first_metrics_s"] == 52.0
    assert out["checkpoint_seconds"] == [(0, 25.5), (10, 21.0)]
    assert out["checkpoint_timing"][1] == {"step": 10, "seconds": 21.0, "write_s": 15.0, "hash_s": 4.0}
    assert [e["event"] for e in out["events"]] == ["checkpoint_good", "precision_changed"]
    assert out["recipe"] == "tensorwise" and out["status"] == "completed" and out["final_step"] == 10
    assert out["losses"][0] == (2, 5.0)


def test_an_unfinished_run_reports_what_it_has(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "events.jsonl").write_text(json.dumps({"time": 1.0, "event": "run_start", "step": 0}) + "\n")
    out = summarize_run(tmp_path / "r", skip_steps=10)
    assert out["status"] is None and out["tokens_per_s_median"] is None and out["setup_s"] is None
    assert out["first_metrics_s"] is None and out["gpu_mem_peak_gib"] is None
