"""Run comparison report: plots exist, and the data they draw is exactly metrics.jsonl / events.jsonl."""

import json
import statistics
from pathlib import Path

import pytest
import yaml

from orchestration.observability import report, run_data


def _write(run_dir: Path, config: dict, metrics: list[dict], events: list[dict], summary: dict | None = None):
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def _rec(step, loss, tps, ws, precision, mfu=None):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": tps, "world_size": ws,
            "precision": precision, "mfu": mfu, "time": 1000.0 + step}


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    # bf16 baseline: 30 steps on 2 workers
    bf16 = [_rec(s, 5.0 - 0.1 * s, 1000.0 + s, 2, "bf16", 0.30) for s in range(0, 31, 2)]
    _write(root / "0_bf16", {"model": {"name": "debug_moe"}, "precision": {"name": "bf16", "recipe": "auto"}},
           bf16, [{"time": 0.0, "event": "run_start", "step": 0},
                  {"time": 1.0, "event": "worker_group_start", "step": 0, "world_size": 2, "grad_accum": 2},
                  {"time": 99.0, "event": "run_end", "step": 30, "status": "completed"}],
           summary={"status": "completed"})
    # fp8 run: diverges at step 20, falls back to bf16, rolls back to 14, loses a worker at 22 and resumes on 1
    fp8 = [_rec(s, 5.0 - 0.11 * s, 1300.0 + s, 2, "fp8", 0.20) for s in range(0, 21, 2)]
    fp8 += [_rec(s, 5.0 - 0.105 * s, 1100.0 + s, 2, "bf16", 0.25) for s in (16, 18, 20, 22)]
    fp8 += [_rec(s, 5.0 - 0.104 * s, 560.0 + s, 1, "bf16", 0.25) for s in (22, 24, 26, 28, 30)]
    events = [
        {"time": 0.0, "event": "run_start", "step": 0},
        {"time": 1.0, "event": "worker_group_start", "step": 0, "world_size": 2, "grad_accum": 2},
        {"time": 2.0, "event": "checkpoint_saved", "step": 14, "path": "/x/14", "good": True},
        # agreed decisions are written by every rank (worker_rank = the writer): rank 1's copies must not count;
        # "rank" in divergence_detected is the rank that saw the divergence
        {"time": 3.0, "event": "divergence_detected", "step": 20, "worker_rank": 0, "rank": 1,
         "detector": "loss_spike", "value": 9.0, "threshold": 4.0},
        {"time": 3.0, "event": "divergence_detected", "step": 20, "worker_rank": 1, "rank": 1,
         "detector": "loss_spike", "value": 9.0, "threshold": 4.0},
        {"time": 3.1, "event": "precision_changed", "step": 20, "from": "fp8", "to": "bf16", "scope": "model",
         "worker_rank": 0},
        {"time": 3.1, "event": "precision_changed", "step": 20, "from": "fp8", "to": "bf16", "scope": "model",
         "worker_rank": 1},
        # written after the restore: step = to_step, from_step = where the rollback happened
        {"time": 3.2, "event": "rollback", "step": 14, "from_step": 20, "to_step": 14, "skipped_samples": 32,
         "worker_rank": 0},
        {"time": 3.2, "event": "rollback", "step": 14, "from_step": 20, "to_step": 14, "skipped_samples": 32,
         "worker_rank": 1},
        {"time": 4.0, "event": "worker_lost", "step": 22, "previous_world_size": 2},
        {"time": 5.0, "event": "worker_group_start", "step": 20, "world_size": 1, "grad_accum": 4},
        {"time": 5.0, "event": "resume", "step": 20, "from_step": 20, "world_size": 1},
        {"time": 9.0, "event": "run_end", "step": 30, "status": "completed"},
    ]
    _write(root / "1_fp8", {"model": {"name": "debug_moe"}, "precision": {"name": "fp8", "recipe": "rowwise"}},
           fp8, events)
    return root


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_series_equal_metrics_jsonl(sweep):
    for run_dir in sorted(sweep.iterdir()):
        m = _metrics(run_dir)
        s = report.run_series(report.load_run(run_dir))
        assert s.loss_steps == [r["step"] for r in m] and s.loss == [r["loss"] for r in m]
        assert s.throughput_steps == s.loss_steps and s.tokens_per_s == [r["tokens_per_s"] for r in m]
        assert s.world_size == [r["world_size"] for r in m]
        assert s.precision == [r["precision"] for r in m]
        assert s.mfu == [r["mfu"] for r in m]
    s = report.run_series(report.load_run(sweep / "1_fp8"))
    assert s.fallback_steps == [20] and s.rollbacks == [(20, 14)] and s.restart_steps == [20]
    assert s.worker_lost_steps == [22] and s.recovery_steps == []


def test_segments_spans_and_effective_curve(sweep):
    s = report.run_series(report.load_run(sweep / "1_fp8"))
    segs = run_data.segments(s.loss_steps, s.loss)
    assert [seg[0] for seg in segs] == [list(range(0, 21, 2)), [16, 18, 20, 22], [22, 24, 26, 28, 30]]
    # effective timeline: fp8 until the rollback's re-run from 16 replaced steps 16..20 with bf16
    assert run_data.precision_spans(s.precision_steps, s.precision) == [(0, 16, "fp8"), (16, 30, "bf16")]
    assert run_data.precision_spans([0, 2, 4, 6], ["fp8", "bf16", "bf16", "fp8"]) == [
        (0, 2, "fp8"), (2, 6, "bf16"), (6, 6, "fp8")]
    curve = report.effective_curve(s.loss_steps, s.loss)
    assert list(curve) == list(range(0, 31, 2))
    assert curve[16] == pytest.approx(5.0 - 0.105 * 16)  # the value logged after the rollback wins
    assert curve[22] == pytest.approx(5.0 - 0.104 * 22)


def test_build_report_writes_plots_whose_data_match(sweep, tmp_path):
    out = tmp_path / "out"
    md = report.build_report([sweep], out)
    assert md == out / "report.md"
    for name in report.PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    # The lines on the loss figure, joined per run, are the metrics.jsonl values in order.
    series = [report.run_series(report.load_run(d)) for d in sorted(sweep.iterdir())]
    fig = report.plot_loss(series, tmp_path / "again.png")
    ax = fig.axes[0]
    for run_dir in sorted(sweep.iterdir()):
        lines = [ln for ln in ax.lines if ln.get_gid() == f"data:{run_dir.name}"]  # not the event markers
        xs = [x for ln in lines for x in ln.get_xdata()]
        ys = [y for ln in lines for y in ln.get_ydata()]
        m = _metrics(run_dir)
        assert xs == [r["step"] for r in m] and ys == [r["loss"] for r in m]
    fig = report.plot_world_size(series, tmp_path / "ws.png")
    ws_lines = [ln for ln in fig.axes[0].lines if ln.get_gid() == "data:1_fp8"]
    assert [y for ln in ws_lines for y in ln.get_ydata()] == [r["world_size"] for r in _metrics(sweep / "1_fp8")]

    text = md.read_text()
    assert "| 0_bf16 | debug_moe | bf16 | - | completed | 30 |" in text
    assert "| 1_fp8 | debug_moe | fp8 | rowwise | completed | 30 |" in text
    html = (out / "report.html").read_text()
    assert "<table>" in html and all(f'src="{p}"' in html for p in report.PLOTS)


def test_stats_and_comparison(sweep):
    runs = [report.load_run(d) for d in sorted(sweep.iterdir())]
    series = [report.run_series(r) for r in runs]
    stats = [report.run_stats(r, s) for r, s in zip(runs, series)]
    fp8_m = _metrics(sweep / "1_fp8")
    assert stats[1]["fallbacks"] == 1 and stats[1]["rollbacks"] == 1 and stats[1]["restarts"] == 1
    assert stats[1]["world_sizes"] == [1, 2]
    assert stats[1]["final_loss"] == pytest.approx(5.0 - 0.104 * 30)
    assert stats[1]["median_tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in fp8_m)
    assert stats[0]["mean_mfu"] == pytest.approx(0.30)
    lines = report.comparison_lines(runs, series, stats)
    ratio = stats[1]["median_tokens_per_s"] / stats[0]["median_tokens_per_s"]
    a, b = 5.0 - 0.1 * 30, 5.0 - 0.104 * 30
    expected = (f"1_fp8 vs 0_bf16: {ratio:.3f}x the median tokens/s; "
                f"loss at step 30 {b:.4f} vs {a:.4f} ({100 * (b - a) / a:+.2f}%)")
    assert lines == [expected]


def test_cli(sweep, capsys):
    assert report.main([str(sweep / "0_bf16"), str(sweep / "1_fp8"), "--out", str(sweep / "cmp")]) == 0
    assert (sweep / "cmp" / "loss.png").stat().st_size > 0
    assert "1_fp8 vs 0_bf16" in capsys.readouterr().out
    assert report.main([str(sweep)]) == 0  # a sweep directory; default output inside it
    assert (sweep / "report" / "report.md").exists()
    assert report.main([str(sweep / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_summary_of_an_interrupted_run_counts_samples_from_its_last_metrics(tmp_path):
    """No final_state.json (the workers never finished): samples_consumed comes from the last metrics line, the
    ranges stay unknown; with a final state, the final state wins."""
    import json

    from orchestration.observability.events import FINAL_STATE_FILE, RunDir, summarize

    run = RunDir(tmp_path / "run")
    run.event("worker_group_start", step=0, world_size=2)
    for step, consumed in ((1, 16), (2, 32), (3, 48)):
        run.metrics({"step": step, "loss": 3.0 - step / 10, "samples_consumed": consumed})
    summary = summarize(run.path, "interrupted")
    assert (summary["final_step"], summary["samples_consumed"], summary["consumed_ranges"]) == (3, 48, None)
    (run.path / FINAL_STATE_FILE).write_text(json.dumps({"step": 3, "samples_consumed": 40,
                                                         "consumed_ranges": [[0, 40]]}))
    assert summarize(run.path, "completed")["samples_consumed"] == 40


def test_summary_counts_what_checkpoints_stalled(tmp_path):
    """summary.json: saves, background saves and the seconds training stood still for them (checkpoint_timing)."""
    from orchestration.observability.events import RunDir, summarize

    run = RunDir(tmp_path / "run")
    run.event("checkpoint_timing", step=0, seconds=12.25, write_s=10.5)
    run.event("checkpoint_timing", step=16, checkpoint_step=8, background=True, seconds=0.5, background_s=3.0)
    run.event("checkpoint_timing", step=24, checkpoint_step=16, background=True, seconds=0.25, background_s=3.5)
    summary = summarize(run.path, "completed")
    assert (summary["checkpoint_saves"], summary["checkpoint_background_saves"]) == (3, 2)
    assert summary["checkpoint_stall_s"] == 13.0


def test_profiled_runs_get_a_table_of_where_their_step_time_went(tmp_path):
    profile = {"event": "profile", "time": 1021.0, "step": 23, "from_step": 20, "steps": 3, "started_time": 1020.0,
               "wall_ms_per_step": 114.317, "trace": "profile/rank0_steps20-22.pt.trace.json.gz",
               "ms_per_step": {"attention": 14.69, "optimizer": 20.432, "fp8_cast_amax": 14.452, "gemm": 46.398,
                               "idle": 4.451}}
    metrics = [_rec(s, 3.0, 1000.0, 1, "fp8") for s in (10, 20, 30)]
    _write(tmp_path / "bf16", {"model": {"name": "m"}}, metrics, [])
    _write(tmp_path / "fp8", {"model": {"name": "m"}}, metrics, [{**profile, "ms_per_step": {"gemm": 1.0}}, profile])
    runs = [report.load_run(tmp_path / name) for name in ("bf16", "fp8")]
    # the last profile of a profiled run, categories in the table's order, idle last; the unprofiled run has no row
    assert report.profile_lines(runs) == [
        "| run | steps | wall ms | attention | optimizer | fp8_cast_amax | gemm | idle |",
        "|---|---|---|---|---|---|---|---|",
        "| fp8 | 20-22 | 114.3 | 14.7 | 20.4 | 14.5 | 46.4 | 4.5 |"]
    assert report.profile_lines(runs[:1]) == []
    report.build_report([tmp_path / "bf16", tmp_path / "fp8"], tmp_path / "out")
    assert "| fp8 | 20-22 | 114.3 | 14.7 | 20.4 | 14.5 | 46.4 | 4.5 |" in (tmp_path / "out" / "report.md").read_text()
    assert "<th>fp8_cast_amax</th>" in (tmp_path / "out" / "report.html").read_text()


def test_resolved_recipe_restarts_and_resumes_as_the_summary_counts_and_emulated_fp8_throughput(tmp_path):
    """A CPU FP8 run (recipe auto, resolved by the workers to rowwise) stopped and started again: the report shows
    the resolved recipe, 0 restarts and 1 resume as summary.json does, and says its tokens/s against BF16 measure
    the emulation, not FP8."""
    from orchestration.observability.events import summarize

    bf16 = [_rec(s, 5.0 - 0.1 * s, 1000.0, 2, "bf16") for s in range(0, 11, 2)]
    _write(tmp_path / "bf16", {"model": {"name": "debug_moe"}, "precision": {"name": "bf16", "recipe": "auto"}}, bf16,
           [{"time": 0.0, "event": "run_start", "step": 0},
            {"time": 1.0, "event": "worker_group_start", "step": 0, "world_size": 2, "device": "cpu",
             "recipe": None}])
    fp8 = [_rec(s, 5.0 - 0.1 * s, 3200.0, 2, "fp8") for s in range(0, 11, 2)]
    events = [{"time": 0.0, "event": "run_start", "step": 0},
              {"time": 1.0, "event": "worker_group_start", "step": 0, "world_size": 2, "device": "cpu",
               "recipe": "rowwise"},
              {"time": 2.0, "event": "run_end", "step": 4, "status": "interrupted"},
              {"time": 3.0, "event": "run_start", "step": 0},
              {"time": 4.0, "event": "worker_group_start", "step": 4, "world_size": 2, "device": "cpu",
               "recipe": "rowwise"},
              {"time": 4.0, "event": "resume", "step": 4, "from_step": 4, "world_size": 2, "origin": "new_start"}]
    _write(tmp_path / "fp8", {"model": {"name": "debug_moe"}, "precision": {"name": "fp8", "recipe": "auto"}}, fp8,
           events)
    summary = summarize(tmp_path / "fp8", "completed")
    runs = [report.load_run(tmp_path / name) for name in ("bf16", "fp8")]
    series = [report.run_series(r) for r in runs]
    stats = [report.run_stats(r, s) for r, s in zip(runs, series)]
    assert stats[1]["recipe"] == "rowwise" and stats[0]["recipe"] is None
    assert (stats[1]["restarts"], stats[1]["resumes"]) == (summary["restarts"], summary["resumes"]) == (0, 1)
    assert stats[1]["fp8_emulated"] and not stats[0]["fp8_emulated"]
    lines = report.comparison_lines(runs, series, stats)
    assert lines[0].startswith("fp8 vs bf16: 3.200x the median tokens/s (FP8 emulated on CPU: not a measure of FP8 "
                               "speed)"), lines
    table = report.render_markdown(stats, lines)
    assert "3,200 (emulated FP8)" in table and "1,000 (emulated" not in table
