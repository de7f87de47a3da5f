"""models/scaling.py reads the product's measured single-GPU steps from the benchmark result files, not copies."""

from __future__ import annotations

import json

import pytest

from models import scaling


@pytest.mark.parametrize("family", sorted(scaling.MEASURED_STEP_FILES))
def test_measured_steps_are_the_result_files_rows(family):
    result = json.loads((scaling.RESULTS_DIR / scaling.MEASURED_STEP_FILES[family]).read_text())
    (config,) = result["results"]["configs"]
    rows = {row["variant"]: row for row in config["rows"]}
    step = scaling.MEASURED_STEPS[family]
    assert step.flavor == config["model"] == family and step.overrides == config["overrides"]
    assert (step.seq_len, step.tokens) == (config["seq"], config["tokens_per_step"])
    assert step.bf16_s == rows["bf16"]["ms"] / 1e3 and step.fp8_s == rows["ours_head:tensorwise"]["ms"] / 1e3
    assert step.optimizer_s == rows["bf16"]["profile_breakdown"]["optimizer"]["ms"] / 1e3
    for precision, variant in (("bf16", "bf16"), ("fp8", "ours_head:tensorwise")):
        profile = rows[variant]["profile_breakdown"]
        assert getattr(step, f"{precision}_gemm_s") == profile["gemm"]["ms"] / 1e3
        assert getattr(step, f"{precision}_loss_s") == profile["cross_entropy_head"]["ms"] / 1e3
    assert 0 < step.optimizer_s < step.fp8_s < step.bf16_s
    assert step.accelerator == scaling.accelerator_of(result["results"]["env"]["device"])
    assert step.source.startswith(f"benchmarks/results/{scaling.MEASURED_STEP_FILES[family]}")


def test_accelerator_names_and_a_missing_results_directory(tmp_path):
    assert scaling.accelerator_of("NVIDIA H100 80GB HBM3") == "h100"
    assert scaling.accelerator_of("NVIDIA H200") == "h200"
    assert scaling.accelerator_of("AMD Instinct MI300X") == "mi300x"
    with pytest.raises(ValueError, match="none of the accelerators"):
        scaling.accelerator_of("NVIDIA A100-SXM4-80GB")
    assert scaling.load_measured_steps(tmp_path) == {}


def test_measured_step_scales_blocks_and_head_apart():
    """A 4-layer step whose blocks take 10 ms each per 1,000 tokens and whose head takes 30 ms (half of it in the
    dense GEMMs' profiled time): the 32-layer workload is 32 blocks and one head, not the 4-layer step's time per FLOP."""
    m = scaling.MeasuredStep("llama3_8b", {"n_layers": 4}, 1000, 1000, "h100", bf16_s=0.080, fp8_s=0.055,
                             optimizer_s=0.010, source="synthetic", bf16_gemm_s=0.050, fp8_gemm_s=0.025,
                             bf16_loss_s=0.005, fp8_loss_s=0.005)
    block_flops, head_flops = 100.0, 60.0  # per token; the head is half of the dense GEMMs' FLOPs (share 0.5)
    w = scaling.workload_from_measurement("w", m, 4 * block_flops + head_flops, 32 * block_flops + head_flops, 2000,
                                          32, 1e9, 1e8, 0.9, head_flops_per_token=head_flops,
                                          measured_head_flops_per_token=head_flops, measured_head_gemm_share=0.5)
    # bf16: head 0.050 * 0.5 + 0.005 = 0.030 s, blocks (0.080 - 0.010 - 0.030) / 4 = 0.010 s each at 1,000 tokens
    assert w.compute_s == pytest.approx(2 * (32 * 0.010 + 0.030))
    # fp8: head 0.0175 s, blocks (0.055 - 0.010 - 0.0175) / 4 = 0.006875 s each
    assert w.fp8_compute_speedup == pytest.approx((32 * 0.010 + 0.030) / (32 * 0.006875 + 0.0175))
    uniform = scaling.workload_from_measurement("w", m, 4 * block_flops + head_flops, 32 * block_flops + head_flops,
                                                2000, 32, 1e9, 1e8, 0.9)
    assert uniform.compute_s == pytest.approx(0.070 / 460 * 3260 * 2)
