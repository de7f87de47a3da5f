"""Model FLOPs utilization: the device's dense peak and the MFU of a measured throughput.

MFU = achieved model FLOP/s per device / dense peak FLOP/s of that device in the precision the matmuls run in.
"Model FLOPs" are the FLOPs of the math the model needs (6N-style plus attention, from
`models.planning.plan_model(...).flops_per_token`), not what the hardware executed (no recompute counted).

Peaks are DENSE tensor-core / matrix-core numbers (vendor datasheets quote sparse numbers twice as large).
An FP8 run is divided by the FP8 peak, a BF16 run by the BF16 peak; so a BF16 run and an FP8 run at the same
tokens/s show different MFU. Compare throughput (tokens/s) across precisions, MFU within one.

Pure Python: no torch import here (callers pass the device name; `device_peak_flops_per_s` asks torch lazily).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak FLOP/s of one device; fp8 is None where the device has no FP8 matrix units."""

    name: str
    bf16: float
    fp8: float | None


# Matched in order against the lower-cased device name (first hit wins), so the more specific patterns
# ("h100 nvl") come before the general ones ("h100").
# NVIDIA numbers: the datasheets' "with sparsity" figures halved.
# AMD numbers: datasheet peaks, which equal CUs x matrix FLOPs/clock/CU x peak engine clock
# (MI300X: 304 CUs x 4096 FP8 FLOPs/clk x 2.1 GHz = 2614.9 TFLOP/s; CDNA4 doubled FLOPs/clk/CU to 8192 for FP8).
_PEAKS: tuple[tuple[tuple[str, ...], DevicePeak], ...] = (
    # H200 NVL datasheet: BF16 1671 TFLOPS, FP8 3341 TFLOPS, both with sparsity.
    (("h200 nvl",), DevicePeak("NVIDIA H200 NVL", 835.5e12, 1670.5e12)),
    # GH200 (Grace Hopper) has the H100 SXM's Hopper GPU: BF16 989.4, FP8 1978.9 dense.
    (("gh200",), DevicePeak("NVIDIA GH200", 989.4e12, 1978.9e12)),
    # H200 SXM datasheet (nvidia.com/en-us/data-center/h200): BF16 1979, FP8 3958 TFLOPS with sparsity.
    (("h200",), DevicePeak("NVIDIA H200 SXM", 989.4e12, 1978.9e12)),
    # H100 NVL datasheet: BF16 1671, FP8 3341 TFLOPS with sparsity (per GPU).
    (("h100 nvl",), DevicePeak("NVIDIA H100 NVL", 835.5e12, 1670.5e12)),
    # H100 PCIe datasheet: BF16 1513, FP8 3026 TFLOPS with sparsity.
    (("h100 pcie", "h100 pci-e"), DevicePeak("NVIDIA H100 PCIe", 756.5e12, 1513.0e12)),
    # H100 SXM datasheet (nvidia.com/en-us/data-center/h100): BF16 1979, FP8 3958 TFLOPS with sparsity.
    # torch reports it as "NVIDIA H100 80GB HBM3".
    (("h100",), DevicePeak("NVIDIA H100 SXM", 989.4e12, 1978.9e12)),
    # A100 datasheet: BF16 312 TFLOPS dense; Ampere has no FP8 tensor cores.
    (("a100",), DevicePeak("NVIDIA A100", 312e12, None)),
    # MI300A datasheet: BF16 980.6, FP8 1961.2 TFLOPS dense (228 CUs).
    (("mi300a",), DevicePeak("AMD Instinct MI300A", 980.6e12, 1961.2e12)),
    # MI325X datasheet: same CDNA3 compute die as the MI300X (more HBM): BF16 1307.4, FP8 2614.9 dense.
    (("mi325x",), DevicePeak("AMD Instinct MI325X", 1307.4e12, 2614.9e12)),
    # MI300X datasheet (amd.com instinct/mi300/mi300x): BF16 1307.4, FP8 2614.9 TFLOPS dense.
    (("mi300x", "mi300"), DevicePeak("AMD Instinct MI300X", 1307.4e12, 2614.9e12)),
    # MI355X datasheet: FP16/BF16 2.5 PFLOPS, FP8 5.0 PFLOPS dense (256 CUs x 2.4 GHz).
    (("mi355x",), DevicePeak("AMD Instinct MI355X", 2516.6e12, 5033.2e12)),
    # MI350X datasheet: FP16/BF16 2.3 PFLOPS, FP8 4.6 PFLOPS dense (256 CUs x 2.2 GHz).
    (("mi350x", "mi350"), DevicePeak("AMD Instinct MI350X", 2306.9e12, 4613.7e12)),
    # Architecture names last, for ROCm stacks whose marketing name is generic or empty.
    # An arch name covers several parts; take the highest peak among them so MFU is never overstated.
    # gfx942 is CDNA3 (MI300X, MI300A, MI325X): the MI300X/MI325X numbers.
    (("gfx942",), DevicePeak("AMD Instinct MI300X", 1307.4e12, 2614.9e12)),
    # gfx950 is CDNA4 (MI350X, MI355X): the MI355X numbers (higher clock).
    (("gfx950",), DevicePeak("AMD Instinct MI355X", 2516.6e12, 5033.2e12)),
)


def _check_precision(precision: str) -> str:
    p = str(precision).lower()
    if p not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} for a peak FLOP/s lookup, got {precision!r}")
    return p


def lookup_device(device_name: str) -> DevicePeak | None:
    """The peak entry for a device name (torch.cuda.get_device_name or a gcnArchName), None if unknown or CPU."""
    name = (device_name or "").strip().lower()
    if not name or name == "cpu" or name.startswith("cpu"):
        return None
    for patterns, peak in _PEAKS:
        if any(p in name for p in patterns):
            return peak
    return None


def peak_flops_per_s(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one device in `precision` ("bf16" | "fp8").

    Returns None for the CPU, an unknown device, or FP8 on a device without FP8 matrix units: MFU is then not
    reported rather than reported against a made-up peak.
    """
    p = _check_precision(precision)
    peak = lookup_device(device_name)
    if peak is None:
        return None
    return peak.bf16 if p == "bf16" else peak.fp8


def compute_mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    """Fraction (0..1, not percent) of the device's peak used by the model's FLOPs; None without a peak."""
    if peak is None:
        return None
    if not (math.isfinite(peak) and peak > 0):
        raise ValueError(f"peak FLOP/s must be a positive finite number, got {peak!r}")
    if not math.isfinite(flops_per_token) or flops_per_token < 0:
        raise ValueError(f"flops_per_token must be a non-negative finite number, got {flops_per_token!r}")
    if not math.isfinite(tokens_per_s_per_device) or tokens_per_s_per_device < 0:
        raise ValueError(
            f"tokens_per_s_per_device must be a non-negative finite number, got {tokens_per_s_per_device!r}"
        )
    return flops_per_token * tokens_per_s_per_device / peak


def current_device_name(device: object = None) -> str:
    """Name of the accelerator torch runs on ("cpu" when none); torch is imported here, lazily.

    On ROCm the marketing name can be generic ("AMD Radeon Graphics" on some stacks): the gcnArchName
    (gfx942, gfx950) is appended so `lookup_device` still finds the right peak.
    """
    import torch

    dev = torch.device(device) if device is not None else None
    if (dev is not None and dev.type == "cpu") or not torch.cuda.is_available():
        return "cpu"
    index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    arch = getattr(props, "gcnArchName", "") or ""
    return f"{props.name} {arch}".strip()


def device_peak_flops_per_s(precision: str, device: object = None) -> float | None:
    """`peak_flops_per_s` for the device torch runs on (None on CPU)."""
    return peak_flops_per_s(current_device_name(device), precision)
