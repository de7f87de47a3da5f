"""FP8 health statistics of one cast: the definition the divergence monitors read (pure torch, any device).

fp8.quant.health_stats runs it for every cast (no kernel: see there why).
"""

from __future__ import annotations

import math

import torch


def _fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


# Rows of a quantized input sampled for its health statistics: a strided view of at most ~128 rows, so the
# statistics cost no full pass over x (and no host sync).
HEALTH_SAMPLE_ROWS = 64


def health_sample_step(M: int) -> int:
    """Row stride of the health sample: rows 0, step, 2 * step, ... (between 64 and 127 rows when M >= 64)."""
    return max(1, M // HEALTH_SAMPLE_ROWS)


def health_clip_limit(fp8_dtype: torch.dtype) -> float:
    """|x| * scale beyond this was clipped by the cast: past the largest fp8 value by more than half a step, so it
    would not have rounded to max. (Counting values *at* max would flag the amax element that every dynamic scale
    maps exactly onto max, a false alarm on healthy steps.)"""
    mantissa_bits = 2 if fp8_dtype in (torch.float8_e5m2, torch.float8_e5m2fnuz) else 3
    largest = _fp8_max(fp8_dtype)
    # The step at max is that of its binade (2**exponent / 2**mantissa_bits), not max / 2**mantissa_bits: max's own
    # mantissa is above 1 (448 = 1.75 * 2**8), so the latter overstated the half step (476 instead of 464).
    step_at_max = 2.0 ** (math.floor(math.log2(largest)) - mantissa_bits)
    return largest + step_at_max / 2


def health_stats_ref(
    x_hp_MK: torch.Tensor, x_fp8_MK: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """float32 [saturated_frac, underflow_frac, amax] of one quantized 2D input, on device.

    scale: the quantization multiplier, one value (tensorwise) or one per row ([M] or [M, 1]).
    - saturated_frac: fraction of the sampled elements whose scaled value was clipped (see health_clip_limit).
    - underflow_frac: fraction of the sampled elements that were non-zero and quantized to zero.
    - amax: fp8_max / min(scale) over every scale: exact for tensorwise, an upper bound within 2x for
      power-of-two scales; enough for a divergence alarm without a full read of x.
    The fractions come from the rows health_sample_step picks. Fractions are count / count-of-sampled-elements in
    IEEE fp32 division (the Triton kernel computes the same bits). An empty input reports zeros: nothing was
    quantized, so nothing is unhealthy (a NaN would read as a broken FP8 path to the monitors).
    """
    M = x_hp_MK.shape[0]
    if x_hp_MK.numel() == 0:
        return torch.zeros(3, dtype=torch.float32, device=x_hp_MK.device)
    step = health_sample_step(M)
    xs_hp, xs_fp8 = x_hp_MK.detach()[::step], x_fp8_MK[::step].float()
    scale_s = scale.detach().float()
    if scale_s.numel() == M and M > 1:
        scale_s = scale_s.reshape(M, 1)[::step]
    saturated = (xs_hp.float().abs() * scale_s > health_clip_limit(fp8_dtype)).sum(dtype=torch.float32)
    underflow = ((xs_hp != 0) & (xs_fp8 == 0)).sum(dtype=torch.float32)
    counts = torch.stack([saturated, underflow])
    # tensor / tensor: IEEE division (a Python scalar divisor may run as a multiply by its reciprocal).
    fractions = counts / torch.full_like(counts, float(xs_hp.numel()))
    min_scale = scale_s.new_full((1,), float("inf")) if scale.numel() == 0 else scale.detach().float().min().reshape(1)
    amax = torch.full_like(min_scale, _fp8_max(fp8_dtype)) / min_scale
    return torch.cat([fractions, amax])
