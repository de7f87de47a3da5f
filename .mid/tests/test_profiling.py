"""train.profile_from_step: torch.profiler over a window of the real training loop, its trace, summary and event."""

import gzip
import json

import pytest

from orchestration.config import ConfigError
from orchestration.observability import report
from orchestration.observability.events import read_jsonl
from orchestration.observability.kernel_profile import category_of, kernel_breakdown
from tests.test_config import compose_job
from tests.test_guard import make_trainer, train_to_end


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_e4m3e4m3_bf16_tn_n_tilesize128x128x128", "fp8_gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),  # bf16 on an H100 (a profiled product loop)
    ("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN", "fp8_gemm"),
    ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "fp8_gemm"),
    ("triton_red_fused_abs_amax_0", "fp8_cast_amax"),
    ("flash_fwd_kernel", "attention"),
    ("ncclDevKernel_AllGather_RING_LL", "communication"),
    ("aten::mm", "gemm"),
    ("aten::addmm", "gemm"),
    ("aten::_scaled_mm", "fp8_gemm"),
    ("aten::_scaled_grouped_mm", "grouped_gemm"),
    ("aten::nll_loss_forward", "cross_entropy_head"),
    ("aten::mul", "norm_elementwise"),
    # CUTLASS epilogues broadcast a row or column: not a cast
    ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalI8Sm90RowBroadcastILi0EE", "gemm"),
    # torch's grouped GEMMs (the MoE experts' torch._grouped_mm, bf16 and fp8) are CUTLASS kernels with a group
    # problem shape, whatever their epilogue's template arguments name (here a clamp): grouped GEMMs, not casts
    (("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17"
      "GroupProblemShapeIN4cute5tupleIJiiiEEEEENS5_10collective_LinearCombinationClamp"), "grouped_gemm"),
    (("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS1_10"
      "collective13CollectiveMmaINS1_39MainloopSm90ArrayTmaGmmaWarpSpecializedFP8ScaleCast"), "grouped_gemm"),
    ("_rowwise_group_scaled_kernel", "fp8_cast_amax"),  # our cast of a grouped GEMM's gradient, not a GEMM
])
def test_kernel_names_fall_in_their_category(name, category):
    assert category_of(name) == category


def test_breakdown_sums_categories_and_leaves_the_rest_idle():
    rows = [{"kernel": "sm90_xmma_gemm_e4m3e4m3", "us_per_step": 2000.0},
            {"kernel": "triton_red_fused_abs_amax_0", "us_per_step": 400.0},
            {"kernel": "triton_poi_fused_clamp_1", "us_per_step": 100.0},
            {"kernel": "flash_bwd_kernel", "us_per_step": 1000.0},
            {"kernel": "nvjet_hsh_256x128", "us_per_step": 300.0}]
    out = kernel_breakdown(rows, step_ms=5.0)
    assert out == {"fp8_gemm": {"ms": 2.0, "share": 0.4}, "fp8_cast_amax": {"ms": 0.5, "share": 0.1},
                   "attention": {"ms": 1.0, "share": 0.2}, "gemm": {"ms": 0.3, "share": 0.06},
                   "idle": {"ms": 1.2, "share": 0.24}}
    # a row's category, when given, wins over its (shortened) name's: a CUTLASS name's element types come late
    shortened = {"kernel": "_ZN7cutlass13device_kernel", "category": "fp8_gemm", "us_per_step": 500.0}
    assert category_of(shortened["kernel"]) == "gemm"
    assert kernel_breakdown([shortened], step_ms=1.0) == {"fp8_gemm": {"ms": 0.5, "share": 0.5},
                                                         "idle": {"ms": 0.5, "share": 0.5}}


def _profile_of(tmp_path, *overrides):
    trainer = make_trainer(tmp_path, *overrides)
    assert train_to_end(trainer) == "completed"
    run = tmp_path / "run"
    summaries = sorted((run / "profile").glob("*.summary.json"))
    events = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "profile"]
    return run, [json.loads(p.read_text()) for p in summaries], events


def test_the_loop_profiles_its_window_and_writes_trace_summary_and_event(tmp_path):
    run, summaries, events = _profile_of(tmp_path / "three", "train.steps=7", "train.profile_from_step=2",
                                         "train.profile_steps=3")
    assert len(summaries) == 1 and len(events) == 1
    summary, event = summaries[0], events[0]
    assert (summary["from_step"], summary["steps"], summary["steps_seen"], summary["rank"]) == (2, 3, [2, 3, 4], 0)
    assert summary["trace"] == "rank0_steps2-4.pt.trace.json.gz"
    # ended at the top of the iteration after step 4: the event is logged at step 5
    assert (event["step"], event["from_step"], event["steps"]) == (5, 2, 3)
    assert event["started_time"] == summary["started_time"] < event["time"]
    assert event["trace"] == "profile/rank0_steps2-4.pt.trace.json.gz"
    trace = json.loads(gzip.decompress((run / "profile" / summary["trace"]).read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names  # the debug model's bf16 matmuls ran inside the window
    breakdown = summary["breakdown"]
    # the categories and the idle rest make up the window's wall time per step
    assert sum(v["ms"] for v in breakdown.values()) == pytest.approx(summary["wall_ms_per_step"], abs=0.01)
    assert breakdown["gemm"]["ms"] > 0 and breakdown["optimizer"]["ms"] > 0
    assert summary["kernel_ms_per_step"] == pytest.approx(sum(v["ms"] for c, v in breakdown.items() if c != "idle"),
                                                          abs=0.01)
    assert event["ms_per_step"] == {c: v["ms"] for c, v in breakdown.items()}
    # the run report shows it (python -m orchestration.report)
    (row,) = report.profile_lines([report.load_run(run)])[2:]
    assert row.startswith(f"| run | 2-4 | {summary['wall_ms_per_step']:.1f} | ")
    assert row.endswith(f" | {breakdown['idle']['ms']:.1f} |")

    # The same loop profiled over one step: every operator is called as often per step (the window is 3 steps, and
    # per-step figures are divided by 3, not by the iterations the profiler happened to see).
    _, (single,), _ = _profile_of(tmp_path / "one", "train.steps=7", "train.profile_from_step=3",
                                  "train.profile_steps=1")
    calls_three = {r["kernel"]: r["calls_per_step"] for r in summary["top"]}
    calls_one = {r["kernel"]: r["calls_per_step"] for r in single["top"]}
    for op in ("aten::mm", "aten::amax", "_Fp8LinearFn"):  # bf16 matmuls, FP8 scales, FP8 linears
        assert calls_three[op] == calls_one[op] > 0


def test_a_window_past_the_last_step_ends_with_the_loop(tmp_path):
    _, (summary,), (event,) = _profile_of(tmp_path, "train.steps=4", "train.profile_from_step=3",
                                          "train.profile_steps=5")
    assert (summary["from_step"], summary["steps"], summary["trace"]) == (3, 1, "rank0_steps3-3.pt.trace.json.gz")
    assert event["step"] == 4


def test_no_profile_unless_asked(tmp_path):
    run, summaries, events = _profile_of(tmp_path, "train.steps=3")
    assert summaries == [] and events == [] and not (run / "profile").exists()


@pytest.mark.parametrize("override, message", [
    ("train.profile_from_step=10", r"train.profile_from_step: must be in \[0, train.steps=10\)"),
    ("train.profile_from_step=-1", r"train.profile_from_step: must be in"),
    ("train.profile_steps=0", r"train.profile_steps: must be >= 1, got 0"),
])
def test_a_profile_window_outside_the_run_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_job("train.steps=10", override)


def test_a_loop_failing_inside_the_window_stops_the_profiler_and_writes_no_trace(tmp_path):
    import torch

    from orchestration.training.faults import InjectedCrash

    trainer = make_trainer(tmp_path, "train.steps=8", "train.profile_from_step=2", "train.profile_steps=4",
                           "faults=crash", "faults.step=4", "faults.rank=0")
    trainer.start()
    with pytest.raises(InjectedCrash):
        trainer.run()
    assert not torch._C._autograd._profiler_enabled()  # one left running would trace the rest of the process
    assert not (tmp_path / "run" / "profile").exists()
    assert [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "profile"] == []
