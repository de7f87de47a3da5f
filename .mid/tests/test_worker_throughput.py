"""benchmarks/worker_throughput.py's reading of a run directory: the numbers its tables report."""

from __future__ import annotations

import json
import statistics

from benchmarks.worker_throughput import eval_gaps, launcher_command, summarize_run


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


def test_eval_losses_and_their_gap_to_the_baseline(tmp_path):
    metrics = [{"step": 5, "loss": 4.0, "tokens_per_s": 100.0, "time": 1.0},
               {"step": 10, "loss": 3.5, "tokens_per_s": 100.0, "eval_loss": 3.6, "eval_loss_bf16": 3.58, "time": 2.0},
               {"step": 20, "loss": 3.0, "tokens_per_s": 100.0, "eval_loss": 3.1, "eval_loss_bf16": 3.1, "time": 3.0}]
    _write(tmp_path / "fp8", metrics, [], {"status": "completed", "final_eval_loss": 3.1, "eval_s_mean": 0.5})
    out = summarize_run(tmp_path / "fp8", skip_steps=0)
    assert out["eval_losses"] == [(10, 3.6, 3.58), (20, 3.1, 3.1)]
    assert out["final_eval_loss"] == 3.1 and out["eval_s_mean"] == 0.5
    baseline = [(10, 3.5, None), (20, 3.2, None), (30, 3.0, None)]
    gaps = eval_gaps(baseline, out["eval_losses"])
    assert [step for step, _ in gaps] == [10, 20]  # only the steps both evaluated
    assert gaps[0][1] == (3.6 - 3.5) / 3.5 and gaps[1][1] == (3.1 - 3.2) / 3.2


def test_a_ray_variant_runs_the_main_command_and_torchrun_the_one_process_launcher():
    ray = launcher_command("ray", ["model=debug_dense", "run_name=r"])
    assert ray[1:] == ["launch.py", "model=debug_dense", "run_name=r"]
    torchrun = launcher_command("torchrun", ["model=debug_dense"])
    assert torchrun[1:3] == ["-m", "torch.distributed.run"]
    assert torchrun[-3:] == ["-m", "orchestration.driver.torchrun", "model=debug_dense"]


def test_restart_recovery_splits_rays_share_from_ours(tmp_path):
    """A crash at t=100 (the fault marker's time); the new worker starts at 112 (group start 120 minus 5 s of setup
    and 3 s of checkpoint load), trains its first step at 150: Ray 12 s, ours 38 s (setup, load, first step 30 s)."""
    events = [{"time": 0.0, "event": "run_start", "step": 0},
              {"time": 10.0, "event": "worker_group_start", "step": 0},
              {"time": 120.0, "event": "worker_group_start", "step": 8},
              {"time": 120.5, "event": "worker_lost", "step": 8, "last_seen_time": 99.0},
              {"time": 120.6, "event": "resume", "step": 8, "from_step": 8, "origin": "restart", "setup_s": 5.0,
               "checkpoint_load_s": 3.0}]
    metrics = [{"step": 10, "time": 98.0}, {"step": 9, "time": 150.0}, {"step": 10, "time": 150.5}]
    _write(tmp_path / "r", metrics, events, {"status": "completed"})
    (tmp_path / "r" / "faults").mkdir()
    marker = tmp_path / "r" / "faults" / "fault_crash_rank0_step11.fired"
    marker.write_text("crash\n")
    import os
    os.utime(marker, (100.0, 100.0))
    out = summarize_run(tmp_path / "r", skip_steps=0)
    assert out["restart_recovery"] == [{"from_step": 8, "setup_s": 5.0, "checkpoint_load_s": 3.0, "ray_s": 12.0,
                                        "first_step": 9, "first_step_s": 30.0, "failure_to_first_step_s": 50.0}]
    # without the marker the old group's last sign of life stands for the failure
    marker.unlink()
    assert summarize_run(tmp_path / "r", skip_steps=0)["restart_recovery"][0]["ray_s"] == 13.0


def test_rollback_recovery_runs_from_the_decision_to_the_next_step(tmp_path):
    events = [{"time": 0.0, "event": "run_start", "step": 0},
              {"time": 50.0, "event": "divergence_detected", "step": 13, "worker_rank": 0},
              {"time": 50.2, "event": "precision_changed", "step": 13, "worker_rank": 0, "to": "bf16"},
              {"time": 61.0, "event": "rollback", "step": 8, "worker_rank": 0, "from_step": 13, "to_step": 8},
              {"time": 61.0, "event": "rollback", "step": 8, "worker_rank": 1, "from_step": 13, "to_step": 8}]
    metrics = [{"step": 12, "time": 49.0}, {"step": 9, "time": 80.0}]
    _write(tmp_path / "r", metrics, events, {"status": "completed"})
    out = summarize_run(tmp_path / "r", skip_steps=0)
    assert out["rollback_recovery"] == [{"from_step": 13, "to_step": 8, "first_step": 9,
                                         "decision_to_first_step_s": 30.0}]
    assert [e["t_s"] for e in out["events"]] == [50.0, 50.2, 61.0, 61.0]


def test_the_profiled_window_is_left_out_of_the_medians_and_its_summary_reported(tmp_path):
    # metrics every 2 steps, the line at step s written at time 100 + s; steps 10-11 profiled from time 110.0, the
    # profile stopped (trace written) at the start of step 12, its event at 112.5
    tps = {2: 100.0, 4: 60000.0, 6: 61000.0, 8: 62000.0, 10: 63000.0, 12: 20000.0, 14: 30000.0, 16: 64000.0,
           18: 65000.0}
    metrics = [{"step": s, "loss": 1.0, "tokens_per_s": v, "step_time_s": 1.0, "time": 100.0 + s}
               for s, v in tps.items()]
    events = [{"time": 100.0, "event": "run_start", "step": 0},
              {"time": 112.5, "event": "profile", "step": 12, "from_step": 10, "steps": 2, "started_time": 110.0}]
    _write(tmp_path / "r", metrics, events, {"status": "completed", "final_step": 18})
    (tmp_path / "r" / "profile").mkdir()
    summary = {"rank": 0, "from_step": 10, "steps": 2, "wall_ms_per_step": 80.0,
               "breakdown": {"gemm": {"ms": 60.0, "share": 0.75}, "idle": {"ms": 20.0, "share": 0.25}},
               "top": [{"kernel": f"k{i}", "us_per_step": 100.0 - i, "calls_per_step": 1.0} for i in range(30)]}
    (tmp_path / "r" / "profile" / "rank0_steps10-11.summary.json").write_text(json.dumps(summary))
    out = summarize_run(tmp_path / "r", skip_steps=2)
    # line 12 covers the profiled steps, line 14 the step whose start wrote the trace; 10 and 16 neither
    assert out["steady_log_lines"] == 6
    assert out["tokens_per_s_median"] == statistics.median([60000.0, 61000.0, 62000.0, 63000.0, 64000.0, 65000.0])
    assert out["profile"] == [summary]
