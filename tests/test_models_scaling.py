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
