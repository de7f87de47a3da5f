"""FP8 training numerics: pure functions and modules, no distributed code, nothing of ours imported.

Public API (docs/INTERFACES.md, "fp8/"): convert_to_fp8, set_precision, precision_state, load_precision_state,
fp8_dtypes, recommended_recipe, RECIPES, fp8_health, Float8Linear. Hardware is probed lazily (fp8.backend).
"""

from fp8.backend import fp8_dtypes, get_backend, recommended_recipe
from fp8.convert import (
    convert_to_fp8,
    default_module_filter,
    fp8_health,
    load_precision_state,
    precision_state,
    set_precision,
)
from fp8.grouped import Fp8GroupedMM, fp8_grouped_mm
from fp8.linear import Float8Linear
from fp8.recipes import RECIPES, Recipe

__all__ = [
    "RECIPES",
    "Float8Linear",
    "Fp8GroupedMM",
    "Recipe",
    "convert_to_fp8",
    "default_module_filter",
    "fp8_dtypes",
    "fp8_grouped_mm",
    "fp8_health",
    "get_backend",
    "load_precision_state",
    "precision_state",
    "recommended_recipe",
    "set_precision",
]
