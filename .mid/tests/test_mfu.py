"""MFU: device peaks from datasheet dense numbers, and the MFU formula."""

import math

import pytest

from orchestration.observability import mfu


@pytest.mark.parametrize(
    "device_name, precision, expected_tflops",
    [
        # names as torch.cuda.get_device_name reports them
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp8", 1670.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200", "fp8", 1978.9),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("AMD Instinct MI300X", "fp8", 2614.9),
        ("AMD Instinct MI300X VF", "fp8", 2614.9),
        ("AMD Instinct MI325X", "fp8", 2614.9),
        ("AMD Instinct MI300A", "bf16", 980.6),
        ("AMD Instinct MI350X", "bf16", 2306.9),
        ("AMD Instinct MI350X", "fp8", 4613.7),
        ("AMD Instinct MI355X", "fp8", 5033.2),
        # gcnArchName, alone or appended to a generic marketing name
        ("gfx942:sramecc+:xnack-", "fp8", 2614.9),
        ("AMD Radeon Graphics gfx942:sramecc+:xnack-", "bf16", 1307.4),
        ("gfx950", "bf16", 2516.6),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ],
)
def test_peak_flops_known_devices(device_name, precision, expected_tflops):
    got = mfu.peak_flops_per_s(device_name, precision)
    assert got == pytest.approx(expected_tflops * 1e12, rel=1e-9)


def test_fp8_peak_is_twice_bf16_on_fp8_devices():
    # Hopper and CDNA3/4 run dense FP8 at exactly twice the BF16 rate (datasheets); a typo in the table shows here.
    for name in ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "AMD Instinct MI300X",
                 "AMD Instinct MI350X", "AMD Instinct MI355X", "AMD Instinct MI300A"]:
        bf16 = mfu.peak_flops_per_s(name, "bf16")
        fp8 = mfu.peak_flops_per_s(name, "fp8")
        assert fp8 == pytest.approx(2 * bf16, rel=2e-3), name


def test_peak_none_for_cpu_unknown_and_missing_fp8():
    assert mfu.peak_flops_per_s("cpu", "bf16") is None
    assert mfu.peak_flops_per_s("", "fp8") is None
    assert mfu.peak_flops_per_s("Some Future Accelerator", "bf16") is None
    assert mfu.peak_flops_per_s("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 tensor cores


def test_peak_rejects_unknown_precision():
    with pytest.raises(ValueError, match="precision"):
        mfu.peak_flops_per_s("NVIDIA H200", "fp16x")


def test_compute_mfu_formula():
    # Llama3-8B-like: 6 * 8e9 FLOPs/token, 8532 tokens/s/GPU (torchtitan float8 anchor) on an H100 in fp8.
    peak = mfu.peak_flops_per_s("NVIDIA H100 80GB HBM3", "fp8")
    got = mfu.compute_mfu(6 * 8.0e9, 8532.0, peak)
    assert got == pytest.approx(6 * 8.0e9 * 8532.0 / 1978.9e12, rel=1e-12)
    assert 0.2 < got < 0.21
    assert mfu.compute_mfu(1e9, 100.0, None) is None
    assert mfu.compute_mfu(0.0, 100.0, 1e12) == 0.0


@pytest.mark.parametrize("args", [(1e9, 1.0, 0.0), (1e9, 1.0, -1.0), (-1.0, 1.0, 1e12), (1e9, math.nan, 1e12)])
def test_compute_mfu_rejects_bad_inputs(args):
    with pytest.raises(ValueError):
        mfu.compute_mfu(*args)


def test_current_device_on_cpu_machine():
    import torch

    if torch.cuda.is_available():
        assert mfu.current_device_name() != "cpu"
    else:
        assert mfu.current_device_name() == "cpu"
        assert mfu.device_peak_flops_per_s("bf16") is None
    assert mfu.current_device_name("cpu") == "cpu"
