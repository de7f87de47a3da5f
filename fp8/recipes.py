"""Scaling recipes and the pure-PyTorch quantization math (amax -> scale -> saturating cast).

Convention everywhere in fp8/: `x_fp8 = saturate(x_hp * scale)`, so `x_hp ~= x_fp8 / scale`. The scaled
matmuls take the *inverse* scales (dequantization multipliers).

Shape legend: M rows (tokens), K contraction dim, N output features, E experts (groups).
Suffixes: _hp high precision (bf16/fp32), _fp8 quantized data, _t transposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Smallest amax used to form a scale. fp8_max / 1e-12 stays finite in float32 (4.5e14 for e4m3), so an
# all-zero (or denormal-only) tensor gets a large finite scale and casts to exact zeros instead of inf/NaN.
AMAX_EPS = 1e-12


@dataclass(frozen=True)
class Recipe:
    """How the three GEMMs of a linear layer are quantized.

    granularity: "tensorwise" (one scale per tensor) or "rowwise" (one scale per row of each GEMM operand,
        along the contraction dim).
    pow2_scales: round scales down to a power of two, so scaling is exact (only the fp8 cast rounds).
    grad_output_e5m2: quantize grad_output to e5m2 (range) instead of e4m3 (precision).
    grad_weight_hp: compute grad_weight = grad_output^T @ input in high precision (no fp8).

    With rowwise, the weight of the grad_input GEMM is scaled per column (along N, its contraction dim);
    the fused row+column cast produces both layouts in one pass, so this costs nothing over torchao's
    tensorwise weight in rowwise_with_gw_hp and is more accurate.
    """

    name: str
    granularity: str
    pow2_scales: bool
    grad_output_e5m2: bool
    grad_weight_hp: bool


RECIPES: dict[str, Recipe] = {
    "tensorwise": Recipe("tensorwise", "tensorwise", pow2_scales=False, grad_output_e5m2=True, grad_weight_hp=False),
    "rowwise": Recipe("rowwise", "rowwise", pow2_scales=True, grad_output_e5m2=False, grad_weight_hp=False),
    "rowwise_gw_hp": Recipe("rowwise_gw_hp", "rowwise", pow2_scales=True, grad_output_e5m2=False, grad_weight_hp=True),
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe]


def amax_to_scale(amax: torch.Tensor, fp8_max: float, pow2: bool) -> torch.Tensor:
    """float32 scale mapping |x| <= amax onto the fp8 range. Finite for amax == 0 (see AMAX_EPS)."""
    scale = fp8_max / amax.float().clamp(min=AMAX_EPS)
    if pow2:
        # Round down to a power of two by clearing the fp32 mantissa bits (exact; amax * scale stays
        # <= fp8_max), so multiplying by the scale is exact and only the fp8 cast rounds. A NaN scale (NaN in x)
        # stays NaN, as in the Triton kernels. (fp8.kernels.reference.pow2_floor computes the same, but this path
        # must work when the kernels package cannot import: tests/test_fp8_dispatch.py.)
        bits = (scale.contiguous().view(torch.int32) & 0x7F800000).view(torch.float32).view(scale.shape)
        scale = torch.where(scale.isnan(), scale, bits)
    return scale


def cast_saturated(x_hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: values beyond the fp8 range clamp to +-max instead of becoming inf/NaN."""
    fp8_max = float(torch.finfo(dtype).max)
    return (x_hp.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def quantize_tensorwise_ref(x_hp: torch.Tensor, dtype: torch.dtype, pow2: bool = False):
    """-> (x_fp8 same shape, scale 0-d float32)."""
    amax = x_hp.detach().abs().amax().float()
    scale = amax_to_scale(amax, float(torch.finfo(dtype).max), pow2)
    return cast_saturated(x_hp, scale, dtype), scale


def quantize_rowwise_ref(x_hp: torch.Tensor, dtype: torch.dtype, dim: int = -1, pow2: bool = True):
    """One scale per slice along `dim` (the reduced dim). x (M, K), dim=-1 -> scale (M, 1); dim=0 -> (1, K)."""
    amax = x_hp.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = amax_to_scale(amax, float(torch.finfo(dtype).max), pow2)
    return cast_saturated(x_hp, scale, dtype), scale


def quantize_rowwise_and_colwise_ref(x_MN: torch.Tensor, dtype: torch.dtype, pow2: bool = True):
    """Row-scaled copy for one GEMM and column-scaled, transposed copy for the other, from one read.

    -> (x_fp8_MN row-major, scale_M1, x_fp8_t_NM row-major [N, M], scale_1N). `x_fp8_t_NM.t()` is the
    column-scaled x as the column-major [M, N] operand _scaled_mm wants on the right.
    """
    abs_MN = x_MN.detach().abs()
    fp8_max = float(torch.finfo(dtype).max)
    scale_M1 = amax_to_scale(abs_MN.amax(dim=1, keepdim=True), fp8_max, pow2)
    scale_1N = amax_to_scale(abs_MN.amax(dim=0, keepdim=True), fp8_max, pow2)
    x_fp8_MN = cast_saturated(x_MN, scale_M1, dtype)
    x_fp8_t_NM = cast_saturated(x_MN, scale_1N, dtype).t().contiguous()
    return x_fp8_MN, scale_M1, x_fp8_t_NM, scale_1N


def group_ids(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index of each row for cumulative end offsets; rows past offs[-1] get E (padding)."""
    rows_M = torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows_M, right=True)


def quantize_jagged_colwise_ref(x_MK: torch.Tensor, offs_E: torch.Tensor, dtype: torch.dtype, pow2: bool = True):
    """Per-expert, per-column scales over each group's rows (the scales of the grad-weight grouped GEMM).

    -> (x_fp8_t_KM [K, M] contiguous, scales_EK float32) where x_fp8_t_KM[k, m] = sat(x[m, k] *
    scales_EK[group(m), k]); `.t()` is the column-major [M, K] operand of a 2D x 2D grouped GEMM.
    Empty groups get the (finite) scale of an all-zero slice; rows past offs[-1] quantize to zero.
    """
    num_groups = offs_E.shape[0]
    gid_M = group_ids(offs_E, x_MK.shape[0]).long()
    amax_GK = torch.zeros(num_groups + 1, x_MK.shape[1], device=x_MK.device, dtype=torch.float32)
    amax_GK.scatter_reduce_(0, gid_M[:, None].expand_as(x_MK), x_MK.detach().abs().float(), "amax")
    scales_EK = amax_to_scale(amax_GK[:num_groups], float(torch.finfo(dtype).max), pow2)
    scales_GK = torch.cat([scales_EK, scales_EK.new_zeros(1, x_MK.shape[1])])
    x_fp8_MK = cast_saturated(x_MK, scales_GK[gid_M], dtype)
    return x_fp8_MK.t().contiguous(), scales_EK
