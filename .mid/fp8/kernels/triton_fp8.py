"""Shared pieces of the FP8 Triton kernels: the in-kernel scale formula, the saturating cast, the interpreter's exact
rounding, and how the launchers start a kernel.

Scale convention (as fp8/reference.py, which defines every result): x_fp8 = saturate(x_hp * scale), scale =
fp8_max / max(amax, EPS), optionally rounded down to a power of two; NaN propagates into the scale and the data.

Interpreter (TRITON_INTERPRET=1, CPU tensors): its fp32 -> fp8 cast rounds wrongly (drops the carry into the next
binade), so under the interpreter the kernels first round to the fp8 grid with integer arithmetic
(`_round_to_fp8_grid`, EXACT_ROUND=True) and the cast only sees representable values. On a GPU the hardware cast
(cvt.rn.satfinite) already rounds to nearest even and EXACT_ROUND is False.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from torch.library import wrap_triton

from fp8.reference import EPS, check_fp8_dtype, fp8_max

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the references run instead
    triton = None
    tl = None
    HAS_TRITON = False


_MANTISSA_BITS = {
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
    torch.float8_e4m3fnuz: 3,
    torch.float8_e5m2fnuz: 2,
}


@dataclass(frozen=True)
class Fp8Grid:
    """Constants of an fp8 format for the in-kernel rounding and saturation."""

    max_value: float  # largest finite value
    mbits: int  # mantissa bits
    min_normal: float  # smallest normal value
    sub_magic: float  # 2**(emin - mbits + 23): x + magic - magic rounds to the subnormal grid in fp32
    nan_bits: int  # a NaN bit pattern as int8: 0x7F for e4m3fn/e5m2, 0x80 for the fnuz formats

    @staticmethod
    def of(fp8_dtype: torch.dtype) -> Fp8Grid:
        check_fp8_dtype(fp8_dtype)
        fi = torch.finfo(fp8_dtype)
        mbits = _MANTISSA_BITS[fp8_dtype]  # not from finfo: torch 2.13 reports eps 0.125 for e5m2fnuz (2 bits)
        emin = round(math.log2(fi.smallest_normal))
        nan_bits = -128 if fp8_dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) else 0x7F
        sub_magic = float(2.0 ** (emin - mbits + 23))
        return Fp8Grid(fp8_max(fp8_dtype), mbits, float(fi.smallest_normal), sub_magic, nan_bits)


if HAS_TRITON:

    @triton.jit
    def _max_nan(a, b):
        # NaN-propagating max (max.NaN.f32 on NVIDIA, same cost): a NaN input must reach the scale.
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    # The interpreter runs a tl.reduce combine function in Python per element pair (much slower tests), so there
    # the NaN-dropping tl.max is patched with a NaN count instead. Same condition as the @triton.jit decision.
    _NUMPY_MAX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

    @triton.jit
    def _abs_max(x, axis: tl.constexpr):
        if _NUMPY_MAX:
            a = tl.abs(x.to(tl.float32))
            n_nan = tl.sum((a != a).to(tl.int32), axis)  # noqa: PLR0124 - NaN test
            return tl.where(n_nan > 0, float("nan"), tl.max(a, axis))
        else:
            return tl.reduce(tl.abs(x.to(tl.float32)), axis, _max_nan)

    @triton.jit
    def _scale_from_amax(amax, FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr):
        # Same formula as reference.amax_to_scale: IEEE division (div_rn, explicit so no approximate division
        # can be chosen), then clear the mantissa for power-of-two scales, keeping NaN as NaN.
        amax = _max_nan(amax.to(tl.float32), EPS_)
        scale = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax)
        if POW2:
            p2 = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
            scale = tl.where(scale == scale, p2, scale)  # noqa: PLR0124 - keep NaN
        return scale

    @triton.jit
    def _round_to_fp8_grid(v, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr):
        # Round fp32 v (already saturated) to the nearest-even fp8 value, exactly, for the interpreter.
        # Normal range: round the fp32 bit pattern at bit (23 - MBITS); a carry moves into the exponent correctly.
        SHIFT: tl.constexpr = 23 - MBITS
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        sign = bits ^ mag
        lsb = (mag >> SHIFT) & 1
        mag = (mag + ((1 << (SHIFT - 1)) - 1) + lsb) & ~((1 << SHIFT) - 1)
        normal = (sign | mag).to(tl.float32, bitcast=True)
        # Subnormal range: the grid is uniform, fp32 addition of a magic constant rounds to nearest even.
        a = tl.abs(v)
        sub = (a + SUB_MAGIC) - SUB_MAGIC
        sub = tl.where(v < 0, -sub, sub)
        r = tl.where(a < MIN_NORMAL, sub, normal)
        # +0 instead of -0: the fnuz formats have no -0 (its bit pattern is their NaN).
        return tl.where(r == 0.0, 0.0, r)

    @triton.jit
    def _saturate(v, FP8_MAX: tl.constexpr):
        # propagate_nan=ALL: a NaN must stay NaN, never saturate to +-FP8_MAX (that would hide a divergence).
        v = tl.minimum(v, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        return tl.maximum(v, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _to_fp8(v, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr,
                MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        v = _saturate(v, FP8_MAX)
        if EXACT_ROUND:
            r = _round_to_fp8_grid(v, MBITS, MIN_NORMAL, SUB_MAGIC).to(out_dtype)
            # The interpreter also casts NaN to a finite value: write the format's NaN bit pattern instead.
            bits = tl.where(v != v, NAN_BITS, r.to(tl.int8, bitcast=True))  # noqa: PLR0124
            return bits.to(tl.int8).to(out_dtype, bitcast=True)
        else:
            return v.to(out_dtype)

    INTERPRETED = not isinstance(_max_nan, triton.runtime.JITFunction)
else:
    INTERPRETED = False


@functools.cache
def grid_consts(fp8_dtype: torch.dtype) -> dict:  # cached: host time per launch matters at these sizes
    """The constexpr arguments every casting kernel takes for `fp8_dtype` (its range, rounding and NaN pattern)."""
    g = Fp8Grid.of(fp8_dtype)
    return {"FP8_MAX": g.max_value, "EPS_": EPS, "EXACT_ROUND": INTERPRETED, "MBITS": g.mbits,
            "MIN_NORMAL": g.min_normal, "SUB_MAGIC": g.sub_magic, "NAN_BITS": g.nan_bits}


def launch(kernel):
    """The kernel through wrap_triton, so that when Inductor traces an fp8.kernels.ops op it records the kernel itself
    and launches it from the compiled code; called eagerly, the wrapper just runs the kernel. (The interpreter's
    kernels are not JIT functions; wrap_triton hands those back unchanged.)"""
    return kernel if INTERPRETED else wrap_triton(kernel)


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs on CUDA/ROCm tensors, and on CPU tensors only under the interpreter."""
    return HAS_TRITON and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))


def require_triton(x: torch.Tensor) -> None:
    if not triton_usable(x):
        raise ValueError(
            f"Triton quantize kernels need a CUDA/ROCm tensor (got device {x.device}) or TRITON_INTERPRET=1 set "
            "before fp8.kernels is imported; pass use_triton=False to run the PyTorch reference instead"
        )
