"""Scaling recipes: how the three GEMMs of a linear layer are quantized (the math itself: fp8/reference.py)."""

from __future__ import annotations

from dataclasses import dataclass


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
