"""Triton kernels for FP8 quantization around the GEMMs, and their launchers.

Each kernel matches a reference in `reference.py` (same scale formula, same saturating round-to-nearest-even cast).
The launchers take and return torch tensors; `ops.py` wraps them as torch.library Triton ops.

Kernels (all memory-bound: the work is one or two reads of x and one write per fp8 output):
- tensorwise: `_amax_kernel` (read x, one atomic per block) then `_cast_tensorwise_kernel` (read x, write fp8;
  the scale is computed in-kernel from the amax, so no scale kernel). With a given amax only the cast runs.
- rowwise: `_rowwise_kernel`, one read of x: a program holds BM whole rows in registers when N fits one tile,
  else it loops over N twice (the second loop mostly hits L2).
- rowwise + colwise: `_row_col_amax_kernel` (one read, row and column amax merged with relaxed int32 atomics)
  then `_row_col_cast_kernel` (one read, writes the row-scaled fp8 row-major and the column-scaled fp8 transposed).
  Column scales need every row, so two reads of x is the floor for full-column scales.
- batched column-wise, transposed: `_batched_col_amax_kernel` then `_batched_col_cast_t_kernel`, per batch b
  the column half of the rowwise+colwise pair (MoE expert weights, read in their [E, N, K] storage).
- jagged per expert: `_jagged_amax_kernel` then `_jagged_cast_kernel`, each over (column block, chunk of at most
  JAGGED_CHUNK rows of one expert); the chunk -> expert map is computed on device from offs (no host sync), so the
  work spreads evenly however unbalanced the experts are. (A first version with one program per (expert, column
  block) looping over the expert's rows twice ran at 11-20 % of copy on the H200: the largest expert's program
  set the time.)

Why no triton.autotune: the autotuner re-runs a kernel many times on the first call of each key (the tensorwise
amax kernel accumulates with atomics, so it would need reset hooks), and the interpreter would benchmark too.
The launchers pick block sizes with small heuristics measured on the H200 (benchmarks/fp8_kernels.py sweeps the
candidates); the autotune key would be (N, or K) plus the input dtype, since the tile shape depends only on the
row length and element size, not on M (M only changes the grid).

Interpreter (TRITON_INTERPRET=1, CPU tensors): its fp32 -> fp8 cast rounds wrongly (drops the carry into the next
binade), so under the interpreter the kernels first round to the fp8 grid with integer arithmetic
(`_round_to_fp8_grid`, EXACT_ROUND=True) and the cast only sees representable values. On a GPU the hardware cast
(cvt.rn.satfinite) already rounds to nearest even and EXACT_ROUND is False.

Shape legend: M rows, N (or K) columns, E expert groups; BM/BN/BK tile sizes.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from torch.library import wrap_triton

from .reference import EPS, amax_to_scale, check_fp8_dtype, fp8_max, health_clip_limit, health_sample_step

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the references run instead
    triton = None
    tl = None
    HAS_TRITON = False


def interpreting() -> bool:
    """True when the kernels below were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return INTERPRETED


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

    # The interpreter runs a tl.reduce combine function in Python per element pair (10x slower tests), so there
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

    # ---------------------------------------------------------------- tensorwise

    @triton.jit
    def _amax_kernel(x_ptr, amax_bits_ptr, numel, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
        amax = _abs_max(x, 0)
        # amax >= 0, so its int32 bit pattern orders like the float: one native integer atomic per block
        # (and a NaN, positive after abs, orders above inf: it wins, as in the reference).
        tl.atomic_max(amax_bits_ptr, amax.to(tl.int32, bitcast=True), sem="relaxed")

    @triton.jit
    def _cast_tensorwise_kernel(x_ptr, out_ptr, amax_ptr, scale_ptr, numel,
                                FP8_MAX: tl.constexpr, EPS_: tl.constexpr, BLOCK: tl.constexpr,
                                EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                                SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        pid = tl.program_id(0)
        scale = _scale_from_amax(tl.load(amax_ptr), FP8_MAX, EPS_, False)
        if pid == 0:
            tl.store(scale_ptr, scale)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _to_fp8(x * scale, out_ptr.dtype.element_ty, FP8_MAX, 
                        EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
        tl.store(out_ptr + offs, y, mask=mask)

    # ---------------------------------------------------------------- rowwise

    @triton.jit
    def _times_group_multipliers(x, mul_ptr, gid, mask_m, offs_n, mask, N):
        # x [BM, BN] * mul[gid[m], n] (mul [G, N] fp32 or bf16 contiguous). Rows are sorted by group (hundreds of
        # rows each), so a block's rows nearly always share one: then the multipliers are one [BN] vector for the
        # whole block instead of a [BM, BN] gather (a load per element).
        g_lo = tl.min(tl.where(mask_m, gid, 2147483647), 0)
        if g_lo == tl.max(gid, 0):
            mul_N = tl.load(mul_ptr + g_lo.to(tl.int64) * N + offs_n, mask=offs_n < N, other=0.0)
            x = x * mul_N.to(tl.float32)[None, :]
        else:
            x = x * tl.load(mul_ptr + gid.to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask,
                            other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _rowwise_rows(x_rows, out_rows, scale_ptr, offs_m, mask_m, mul_ptr, gid, N, stride_xn,
                      HAS_MUL: tl.constexpr, FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, ONE_TILE: tl.constexpr,
                      EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                      SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # The row cast of one block of rows. HAS_MUL: of y = x * mul[gid[m], n] instead of x (compile-time: without it
        # mul_ptr and gid are never read and the code is the plain row cast's).
        out_dtype = out_rows.dtype.element_ty
        if ONE_TILE:
            # The whole row block stays in registers: exactly one read of x.
            offs_n = tl.arange(0, BN)
            mask = mask_m[:, None] & (offs_n < N)[None, :]
            x = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
            if HAS_MUL:
                x = _times_group_multipliers(x, mul_ptr, gid, mask_m, offs_n, mask, N)
            scale = _scale_from_amax(_abs_max(x, 1), FP8_MAX, EPS_, POW2)
            y = _to_fp8(x * scale[:, None], out_dtype, FP8_MAX,
                        EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
            tl.store(out_rows + offs_n[None, :], y, mask=mask)
        else:
            amax = tl.zeros([BM], dtype=tl.float32)
            for n0 in range(0, N, BN):
                offs_n = n0 + tl.arange(0, BN)
                mask = mask_m[:, None] & (offs_n < N)[None, :]
                x = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
                if HAS_MUL:
                    x = _times_group_multipliers(x, mul_ptr, gid, mask_m, offs_n, mask, N)
                amax = _max_nan(amax, _abs_max(x, 1))
            scale = _scale_from_amax(amax, FP8_MAX, EPS_, POW2)
            for n0 in range(0, N, BN):
                offs_n = n0 + tl.arange(0, BN)
                mask = mask_m[:, None] & (offs_n < N)[None, :]
                x = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
                if HAS_MUL:
                    x = _times_group_multipliers(x, mul_ptr, gid, mask_m, offs_n, mask, N)
                y = _to_fp8(x * scale[:, None], out_dtype, FP8_MAX,
                            EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
                tl.store(out_rows + offs_n[None, :], y, mask=mask)
        tl.store(scale_ptr + offs_m, scale, mask=mask_m)

    @triton.jit
    def _rowwise_kernel(x_ptr, out_ptr, scale_ptr, M, N, stride_xm, stride_xn,
                        FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, ONE_TILE: tl.constexpr,
                        EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                        SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        # (x_ptr and offs_m stand in for the unread multipliers and group ids)
        _rowwise_rows(x_rows, out_ptr + offs_m.to(tl.int64)[:, None] * N, scale_ptr, offs_m, offs_m < M, x_ptr, offs_m,
                      N, stride_xn, False, FP8_MAX, EPS_, POW2, BM, BN, ONE_TILE,
                      EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)

    @triton.jit
    def _rowwise_group_scaled_kernel(x_ptr, out_ptr, scale_ptr, mul_ptr, gid_ptr, M, N, stride_xm, stride_xn,
                                     FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr,
                                     BM: tl.constexpr, BN: tl.constexpr, ONE_TILE: tl.constexpr,
                                     EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                                     SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # The row cast of y = x * mul[gid[m], n] (mul [G, N] fp32 or bf16 contiguous, gid [M] int32): the grouped
        # grad-input's gradient with the weights' forward row scales folded in (fp8.grouped "fp8_reuse"). Its own
        # kernel, so the plain row cast keeps its signature; both run _rowwise_rows.
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        mask_m = offs_m < M
        gid = tl.load(gid_ptr + offs_m, mask=mask_m, other=0)
        _rowwise_rows(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm, out_ptr + offs_m.to(tl.int64)[:, None] * N,
                      scale_ptr, offs_m, mask_m, mul_ptr, gid, N, stride_xn, True,
                      FP8_MAX, EPS_, POW2, BM, BN, ONE_TILE, EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)

    # ---------------------------------------------------------------- rowwise + colwise (transposed)

    @triton.jit
    def _row_col_amax_kernel(x_ptr, row_amax_bits_ptr, col_amax_bits_ptr, M, N, stride_xm, stride_xn,
                             BM: tl.constexpr, BN: tl.constexpr, N_PER_PROG: tl.constexpr):
        # Program (pid_m, pid_s) covers rows [pid_m*BM, +BM) and columns [pid_s*N_PER_PROG, +N_PER_PROG).
        # Row and column partial maxima go to int32 buffers with atomics (amax >= 0 orders like its bits).
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        mask_m = offs_m < M
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        row_amax = tl.zeros([BM], dtype=tl.float32)
        for n0 in range(pid_s * N_PER_PROG, pid_s * N_PER_PROG + N_PER_PROG, BN):
            offs_n = n0 + tl.arange(0, BN)
            mask_n = offs_n < N
            x = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            row_amax = _max_nan(row_amax, _abs_max(x, 1))
            col_amax = _abs_max(x, 0)
            tl.atomic_max(col_amax_bits_ptr + offs_n, col_amax.to(tl.int32, bitcast=True), mask=mask_n,
                          sem="relaxed")
        tl.atomic_max(row_amax_bits_ptr + offs_m, row_amax.to(tl.int32, bitcast=True), mask=mask_m, sem="relaxed")

    @triton.jit
    def _row_col_cast_kernel(x_ptr, row_out_ptr, col_out_t_ptr, row_amax_ptr, col_amax_ptr,
                             row_scale_ptr, col_scale_ptr, M, N, stride_xm, stride_xn,
                             FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr,
                             EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                             SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_m = offs_m < M
        mask_n = offs_n < N
        mask = mask_m[:, None] & mask_n[None, :]
        # Scales are recomputed per tile from the amax buffers (BM + BN divisions, negligible next to the tile).
        row_scale = _scale_from_amax(tl.load(row_amax_ptr + offs_m, mask=mask_m, other=0.0), FP8_MAX, EPS_, POW2)
        col_scale = _scale_from_amax(tl.load(col_amax_ptr + offs_n, mask=mask_n, other=0.0), FP8_MAX, EPS_, POW2)
        if pid_n == 0:
            tl.store(row_scale_ptr + offs_m, row_scale, mask=mask_m)
        if pid_m == 0:
            tl.store(col_scale_ptr + offs_n, col_scale, mask=mask_n)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :] * stride_xn,
                    mask=mask, other=0.0).to(tl.float32)
        out_dtype = row_out_ptr.dtype.element_ty
        y_row = _to_fp8(x * row_scale[:, None], out_dtype, FP8_MAX, 
                        EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
        tl.store(row_out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], y_row, mask=mask)
        y_col = _to_fp8(x * col_scale[None, :], out_dtype, FP8_MAX, 
                        EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
        # Transposed store [BN, BM] into the [N, M] row-major output: runs of BM contiguous bytes per column.
        tl.store(col_out_t_ptr + offs_n.to(tl.int64)[:, None] * M + offs_m[None, :], tl.trans(y_col),
                 mask=mask_n[:, None] & mask_m[None, :])

    # ---------------------------------------------------------------- transpose (fp8 operands for _scaled_mm)

    @triton.jit
    def _transpose_kernel(x_ptr, out_t_ptr, M, N, stride_xm, stride_xn, BM: tl.constexpr, BN: tl.constexpr):
        # Tile [BM, BN] read along N, stored transposed into the [N, M] row-major output (runs of BM elements).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :] * stride_xn,
                    mask=mask_m[:, None] & mask_n[None, :])
        tl.store(out_t_ptr + offs_n.to(tl.int64)[:, None] * M + offs_m[None, :], tl.trans(x),
                 mask=mask_n[:, None] & mask_m[None, :])

    # ---------------------------------------------------------------- batched column scales, transposed output

    @triton.jit
    def _batched_col_amax_kernel(x_ptr, col_amax_bits_ptr, R, C, stride_xb, stride_xr, stride_xc,
                                 BR: tl.constexpr, BC: tl.constexpr, R_PER_PROG: tl.constexpr):
        # Program (pid_c, pid_s, b): columns [pid_c*BC, +BC) of batch b over rows [pid_s*R_PER_PROG, +R_PER_PROG).
        pid_c = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_c = pid_c * BC + tl.arange(0, BC)
        mask_c = offs_c < C
        x_b = x_ptr + b * stride_xb
        amax = tl.zeros([BC], dtype=tl.float32)
        for r0 in range(pid_s * R_PER_PROG, pid_s * R_PER_PROG + R_PER_PROG, BR):
            offs_r = r0 + tl.arange(0, BR)
            mask = (offs_r < R)[:, None] & mask_c[None, :]
            x = tl.load(x_b + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c[None, :] * stride_xc, mask=mask,
                        other=0.0)
            amax = _max_nan(amax, _abs_max(x, 0))
        tl.atomic_max(col_amax_bits_ptr + b * C + offs_c, amax.to(tl.int32, bitcast=True), mask=mask_c,
                      sem="relaxed")

    @triton.jit
    def _cast_tile_store_t(x_ptr, out_t_ptr, b, offs_r, offs_c, mask_r, mask_c, scale_RC, R, C,
                           stride_xb, stride_xr, stride_xc, FP8_MAX: tl.constexpr,
                           EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                           SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # Tile [BR, BC] of batch b of x (any strides) times scale_RC (broadcast along rows or columns), cast and
        # stored transposed into the contiguous [B, C, R] output (runs of BR bytes).
        x = tl.load(x_ptr + b * stride_xb + offs_r.to(tl.int64)[:, None] * stride_xr + offs_c[None, :] * stride_xc,
                    mask=mask_r[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        y = _to_fp8(x * scale_RC, out_t_ptr.dtype.element_ty, FP8_MAX,
                    EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
        out_t = out_t_ptr + b * C * R + offs_c.to(tl.int64)[:, None] * R + offs_r[None, :]
        tl.store(out_t, tl.trans(y), mask=mask_c[:, None] & mask_r[None, :])

    @triton.jit
    def _batched_col_cast_t_kernel(x_ptr, col_amax_ptr, out_t_ptr, scale_ptr, R, C, stride_xb, stride_xr, stride_xc,
                                   FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr,
                                   BR: tl.constexpr, BC: tl.constexpr,
                                   EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                                   SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # Tile [BR, BC] of batch b: one read, scaled per column, stored transposed into [B, C, R] (runs of BR bytes).
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_r = pid_r * BR + tl.arange(0, BR)
        offs_c = pid_c * BC + tl.arange(0, BC)
        mask_r = offs_r < R
        mask_c = offs_c < C
        scale = _scale_from_amax(tl.load(col_amax_ptr + b * C + offs_c, mask=mask_c, other=0.0), FP8_MAX, EPS_,
                                 POW2)
        if pid_r == 0:
            tl.store(scale_ptr + b * C + offs_c, scale, mask=mask_c)
        _cast_tile_store_t(x_ptr, out_t_ptr, b, offs_r, offs_c, mask_r, mask_c, scale[None, :], R, C,
                           stride_xb, stride_xr, stride_xc, FP8_MAX, EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC,
                           NAN_BITS)

    @triton.jit
    def _batched_row_scaled_cast_t_kernel(x_ptr, scale_ptr, out_t_ptr, R, C, stride_xb, stride_xr, stride_xc,
                                          FP8_MAX: tl.constexpr, EPS_: tl.constexpr, BR: tl.constexpr,
                                          BC: tl.constexpr,
                                          EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                                          SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # Tile [BR, BC] of batch b, scaled per row by given scales (no amax pass), stored transposed into [B, C, R].
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_r = pid_r * BR + tl.arange(0, BR)
        offs_c = pid_c * BC + tl.arange(0, BC)
        mask_r = offs_r < R
        mask_c = offs_c < C
        scale = tl.load(scale_ptr + b * R + offs_r, mask=mask_r, other=0.0)
        _cast_tile_store_t(x_ptr, out_t_ptr, b, offs_r, offs_c, mask_r, mask_c, scale[:, None], R, C,
                           stride_xb, stride_xr, stride_xc, FP8_MAX, EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC,
                           NAN_BITS)

    @triton.jit
    def _batched_rows_both_layouts_kernel(x_ptr, out_ptr, out_t_ptr, scale_ptr, R, C, stride_xb, stride_xr,
                                          stride_xc, FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr,
                                          BR: tl.constexpr, BC: tl.constexpr,
                                          EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                                          SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # Rows [pid_r*BR, +BR) of batch b, whole: pass 1 their amax over C, passes 2 and 3 (the re-reads mostly from
        # L2) the cast, stored row-major into [B, R, C] (runs of BC bytes), then transposed into [B, C, R] (runs of BR
        # bytes).
        # The transposed store is why a program holds BR >= 16 rows, not the few rows of the one-tile row cast.
        pid_r = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        offs_r = pid_r * BR + tl.arange(0, BR)
        mask_r = offs_r < R
        x_rows = x_ptr + b * stride_xb + offs_r.to(tl.int64)[:, None] * stride_xr
        amax = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, C, BC):
            offs_c = c0 + tl.arange(0, BC)
            x = tl.load(x_rows + offs_c[None, :] * stride_xc, mask=mask_r[:, None] & (offs_c < C)[None, :], other=0.0)
            amax = _max_nan(amax, _abs_max(x, 1))
        scale = _scale_from_amax(amax, FP8_MAX, EPS_, POW2)
        tl.store(scale_ptr + b * R + offs_r, scale, mask=mask_r)
        out_dtype = out_ptr.dtype.element_ty
        out_rows = out_ptr + b * R * C + offs_r.to(tl.int64)[:, None] * C
        for c0 in range(0, C, BC):
            offs_c = c0 + tl.arange(0, BC)
            mask = mask_r[:, None] & (offs_c < C)[None, :]
            x = tl.load(x_rows + offs_c[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
            y = _to_fp8(x * scale[:, None], out_dtype, FP8_MAX, EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
            tl.store(out_rows + offs_c[None, :], y, mask=mask)
        # The transposed layout in its own pass, tile by tile as the recast kernel writes it. Storing one cast tile
        # both ways in the same iteration (y, then tl.trans(y)) left parts of the transposed output unwritten on the
        # H200 at DeepSeek-MoE's shapes (session 20, tests/test_fp8_gpu.py), though the Triton interpreter agreed.
        for c0 in range(0, C, BC):
            offs_c = c0 + tl.arange(0, BC)
            _cast_tile_store_t(x_ptr, out_t_ptr, b, offs_r, offs_c, mask_r, offs_c < C, scale[:, None], R, C,
                               stride_xb, stride_xr, stride_xc, FP8_MAX, EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC,
                               NAN_BITS)

    # ---------------------------------------------------------------- jagged per-expert column scales

    @triton.jit
    def _jagged_chunk(offs_ptr, M, E, p, CH: tl.constexpr, E_POW2: tl.constexpr):
        # Map program p to (group e, chunk c, rows [lo, hi), aligned chunk base). Chunks lie on a global grid of CH
        # rows (so tiles stay aligned for vector stores) clipped to the group; an empty group gets one empty chunk
        # (it still writes its scale). Group E is the tail of rows past offs[-1] (written as zeros). All on device:
        # the host knows only the bound cdiv(M, CH) + 2 * (E + 1) on the number of chunks.
        idx = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
        ends = tl.where(idx == E, M, ends)
        last = tl.load(offs_ptr + E - 1)  # E >= 1: the launcher handles E == 0 without a kernel
        starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx <= E), other=0)
        starts = tl.where(idx == E, last, starts)
        nonempty = ends > starts
        nchunks = tl.where(nonempty, (ends - 1) // CH - starts // CH + 1, 1)
        nchunks = tl.where(idx <= E, nchunks, 0)
        cum = tl.cumsum(nchunks, 0)  # inclusive prefix: group g owns chunks [cum[g] - nchunks[g], cum[g])
        e = tl.sum((cum <= p).to(tl.int32), 0)
        first = tl.sum(tl.where(idx == e, cum - nchunks, 0), 0)
        start = tl.sum(tl.where(idx == e, starts, 0), 0)
        end = tl.sum(tl.where(idx == e, ends, 0), 0)
        c = p - first
        base = (start // CH + c) * CH
        lo = tl.maximum(base, start)
        hi = tl.minimum(base + CH, end)
        return e, c, lo, hi, base

    @triton.jit
    def _jagged_amax_kernel(x_ptr, offs_ptr, amax_bits_ptr, M, K, stride_xm, stride_xk, E,
                            BM: tl.constexpr, BK: tl.constexpr, CH: tl.constexpr, E_POW2: tl.constexpr):
        # Pass 1: per-(group, column) amax of each chunk, merged with relaxed int32 atomics (amax >= 0).
        pid_k = tl.program_id(0)
        e, _c, lo, hi, base = _jagged_chunk(offs_ptr, M, E, tl.program_id(1), CH, E_POW2)
        offs_k = pid_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        if e < E:
            amax = tl.zeros([BK], dtype=tl.float32)
            for m0 in range(base, hi, BM):
                offs_m = tl.multiple_of(m0, BM) + tl.arange(0, BM)
                mask = ((offs_m >= lo) & (offs_m < hi))[:, None] & mask_k[None, :]
                x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                            mask=mask, other=0.0)
                amax = _max_nan(amax, _abs_max(x, 0))
            tl.atomic_max(amax_bits_ptr + e.to(tl.int64) * K + offs_k, amax.to(tl.int32, bitcast=True),
                          mask=mask_k, sem="relaxed")

    @triton.jit
    def _jagged_cast_kernel(x_ptr, offs_ptr, amax_ptr, out_ptr, scale_ptr, M, K, stride_xm, stride_xk, E,
                            FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr,
                            BM: tl.constexpr, BK: tl.constexpr, CH: tl.constexpr, E_POW2: tl.constexpr,
                            TRANSPOSE_OUT: tl.constexpr,
                            EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                            SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # Pass 2: scale from the group's amax, cast the chunk's rows; group E (rows past offs[-1]) gets zeros.
        pid_k = tl.program_id(0)
        e, c, lo, hi, base = _jagged_chunk(offs_ptr, M, E, tl.program_id(1), CH, E_POW2)
        offs_k = pid_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        if e <= E:
            e_row = tl.minimum(e, E - 1).to(tl.int64)  # the tail group E reads a real row, then ignores it
            amax = tl.load(amax_ptr + e_row * K + offs_k, mask=mask_k, other=0.0)
            # Empty group: amax 0, EPS keeps the scale finite. Tail rows: scale 0 writes zeros.
            scale = tl.where(e < E, _scale_from_amax(amax, FP8_MAX, EPS_, POW2), 0.0)
            if (c == 0) & (e < E):
                tl.store(scale_ptr + e.to(tl.int64) * K + offs_k, scale, mask=mask_k)
            out_dtype = out_ptr.dtype.element_ty
            for m0 in range(base, hi, BM):
                offs_m = tl.multiple_of(m0, BM) + tl.arange(0, BM)
                mask_m = (offs_m >= lo) & (offs_m < hi)
                mask = mask_m[:, None] & mask_k[None, :]
                x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                            mask=mask, other=0.0).to(tl.float32)
                y = _to_fp8(x * scale[None, :], out_dtype, FP8_MAX,
                            EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
                if TRANSPOSE_OUT:
                    out_t = out_ptr + offs_k.to(tl.int64)[:, None] * M + offs_m[None, :]
                    if (m0 >= lo) & (m0 + BM <= hi):
                        # Interior tile: a row mask that varies inside a vector would force byte-wide stores.
                        tl.store(out_t, tl.trans(y), mask=mask_k[:, None])
                    else:
                        tl.store(out_t, tl.trans(y), mask=mask_k[:, None] & mask_m[None, :])
                else:
                    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], y, mask=mask)

    # ---------------------------------------------------------------- health statistics

    @triton.jit
    def _min_nan(a, b):
        return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _health_kernel(x_ptr, q_ptr, scale_ptr, out_ptr, N, step, n_rows, n_scales, n_sampled, stride_xm,
                       stride_xn, stride_qm, stride_qn, scale_row_stride, CLIP: tl.constexpr, FP8_MAX: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr):
        # Program 0 counts clipped and underflowed elements of the sampled rows; program 1 takes the minimum of
        # every scale. Two small independent jobs side by side: one launch instead of ~15 eager torch ops.
        if tl.program_id(0) == 0:
            sat = tl.zeros([BR, BC], dtype=tl.int32)
            und = tl.zeros([BR, BC], dtype=tl.int32)
            for r0 in range(0, n_rows, BR):
                rows = r0 + tl.arange(0, BR)
                mask_r = rows < n_rows
                m = rows.to(tl.int64) * step
                s = tl.load(scale_ptr + m * scale_row_stride, mask=mask_r, other=0.0)
                for c0 in range(0, N, BC):
                    cols = c0 + tl.arange(0, BC)
                    mask = mask_r[:, None] & (cols < N)[None, :]
                    c = cols.to(tl.int64)  # a column-major x has stride_xn = M: M * N may pass 2**31
                    x = tl.load(x_ptr + m[:, None] * stride_xm + c[None, :] * stride_xn, mask=mask, other=0.0)
                    q = tl.load(q_ptr + m[:, None] * stride_qm + c[None, :] * stride_qn, mask=mask, other=0.0)
                    x32 = x.to(tl.float32)
                    sat += ((tl.abs(x32) * s[:, None] > CLIP) & mask).to(tl.int32)
                    und += ((x32 != 0.0) & (q.to(tl.float32) == 0.0) & mask).to(tl.int32)
            # n_sampled: the element count as an fp32 argument (exact below 2**24, as in the reference).
            total = tl.zeros([], dtype=tl.float32) + n_sampled
            tl.store(out_ptr, tl.math.div_rn(tl.sum(tl.sum(sat, 1), 0).to(tl.float32), total))
            tl.store(out_ptr + 1, tl.math.div_rn(tl.sum(tl.sum(und, 1), 0).to(tl.float32), total))
        else:
            acc = tl.full([BS], float("inf"), dtype=tl.float32)
            for s0 in range(0, n_scales, BS):
                offs = s0 + tl.arange(0, BS)
                v = tl.load(scale_ptr + offs, mask=offs < n_scales, other=float("inf"))
                acc = _min_nan(acc, v)
            if _NUMPY_MAX:  # the interpreter: a NaN count instead of a Python combine function (see _abs_max)
                n_nan = tl.sum((acc != acc).to(tl.int32), 0)  # noqa: PLR0124 - NaN test
                smin = tl.where(n_nan > 0, float("nan"), tl.min(acc, 0))
            else:
                smin = tl.reduce(acc, 0, _min_nan)
            tl.store(out_ptr + 2, tl.math.div_rn(tl.zeros_like(smin) + FP8_MAX, smin))

    INTERPRETED = not isinstance(_amax_kernel, triton.runtime.JITFunction)
else:
    INTERPRETED = False


# -------------------------------------------------------------------- launchers


@functools.cache
def _grid_consts(fp8_dtype: torch.dtype) -> dict:  # cached: host time per launch matters at these sizes
    g = Fp8Grid.of(fp8_dtype)
    return {"FP8_MAX": g.max_value, "EPS_": EPS, "EXACT_ROUND": INTERPRETED, "MBITS": g.mbits,
            "MIN_NORMAL": g.min_normal, "SUB_MAGIC": g.sub_magic, "NAN_BITS": g.nan_bits}


def _launch(kernel):
    # Through wrap_triton, so that when Inductor traces an fp8.kernels.ops op it records the kernel itself and
    # launches it from the compiled code; called eagerly, the wrapper just runs the kernel. (The interpreter's
    # kernels are not JIT functions; wrap_triton hands those back unchanged.)
    return kernel if INTERPRETED else wrap_triton(kernel)


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs on CUDA/ROCm tensors, and on CPU tensors only under the interpreter."""
    return HAS_TRITON and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))


def _require(x: torch.Tensor) -> None:
    if not triton_usable(x):
        raise ValueError(
            f"Triton quantize kernels need a CUDA/ROCm tensor (got device {x.device}) or TRITON_INTERPRET=1 set "
            "before fp8.kernels is imported; pass use_triton=False to run the PyTorch reference instead"
        )


# Tile heuristics (the would-be autotune key: row length N/K and element size; see module docstring).
TENSORWISE_BLOCK = 8192  # elements per program: 16 KB of bf16, 8 warps -> 32 elements a thread
# H200 sweep (benchmarks/results/fp8_kernels_sweep.json): 8192-element tiles were best for rows of 2048 and 4096
# (26.3 vs 27.5 us at 8192x4096), whole 16384-padded rows best for 14336 (87.0 vs 97.3 us with 8192 and a loop).
ROWWISE_MAX_TILE = 8192  # elements a program holds in registers (BM * BN) when several rows share a program
ROWWISE_MAX_ROW = 16384  # longest (padded) row kept whole in registers; longer rows loop over BN = ROWWISE_MAX_TILE
# (128, 64) beat (64, 128) by 23-30 % on the whole rowwise+colwise op: half the column atomics.
ROW_COL_AMAX_TILE = (128, 64)  # (BM, BN) of the amax pass
ROW_COL_CAST_TILE = (64, 128)  # (BM, BN) of the cast pass
JAGGED_TILE = (128, 64)  # (BM, BK): BK bf16 columns = 128 B contiguous reads; BM fp8 = 128 B transposed runs
JAGGED_CHUNK = 512  # rows per program: parallelism no longer depends on the largest expert
TENSORWISE_WARPS = 8
ROWWISE_WARPS = 8
ROW_COL_AMAX_WARPS = 8
ROW_COL_WARPS = 8
JAGGED_WARPS = 4


def tensorwise_amax(x_hp: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor, on device (no host sync)."""
    _require(x_hp)
    x_flat = x_hp.contiguous().view(-1)
    amax_bits = torch.zeros(1, dtype=torch.int32, device=x_hp.device)
    numel = x_flat.numel()
    grid = (max(1, triton.cdiv(numel, TENSORWISE_BLOCK)),)
    _launch(_amax_kernel)[grid](x_flat, amax_bits, numel, BLOCK=TENSORWISE_BLOCK, num_warps=TENSORWISE_WARPS)
    return amax_bits.view(torch.float32).reshape(())


def quantize_tensorwise_triton(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    _require(x_hp)
    if amax is None:
        amax = tensorwise_amax(x_hp)
    amax = amax.reshape(1).to(device=x_hp.device, dtype=torch.float32)
    x_flat = x_hp.contiguous().view(-1)
    out = torch.empty(x_hp.shape, dtype=fp8_dtype, device=x_hp.device)
    scale = torch.empty((), dtype=torch.float32, device=x_hp.device)
    numel = x_flat.numel()
    grid = (max(1, triton.cdiv(numel, TENSORWISE_BLOCK)),)
    _launch(_cast_tensorwise_kernel)[grid](x_flat, out.view(-1), amax, scale, numel, BLOCK=TENSORWISE_BLOCK,
                                  num_warps=TENSORWISE_WARPS, **_grid_consts(fp8_dtype))
    return out, scale


def rowwise_tile(N: int, max_tile: int | None = None) -> tuple[int, int, bool]:
    """(BM, BN, one_tile) for rows of N elements: whole rows in registers when a row fits max_tile."""
    max_tile = ROWWISE_MAX_TILE if max_tile is None else max_tile
    BN = triton.next_power_of_2(max(N, 1))
    if BN <= max(max_tile, ROWWISE_MAX_ROW):
        return max(1, min(max_tile // BN, 64)), BN, True
    return 1, max_tile, False


def quantize_rowwise_triton(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    _require(x_hp_MN)
    M, N = x_hp_MN.shape
    out_MN = torch.empty((M, N), dtype=fp8_dtype, device=x_hp_MN.device)
    scale_M1 = torch.empty((M, 1), dtype=torch.float32, device=x_hp_MN.device)
    if M == 0:
        return out_MN, scale_M1
    BM, BN, one_tile = rowwise_tile(N)
    grid = (triton.cdiv(M, BM),)
    _launch(_rowwise_kernel)[grid](x_hp_MN, out_MN, scale_M1, M, N, x_hp_MN.stride(0), x_hp_MN.stride(1), POW2=pow2,
                          BM=BM, BN=BN, ONE_TILE=one_tile, num_warps=ROWWISE_WARPS, **_grid_consts(fp8_dtype))
    return out_MN, scale_M1


def quantize_rowwise_group_scaled_triton(
    x_hp_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise quantization of y = x * mul_GN[gid_M[m], :] in one read of x (see reference)."""
    _require(x_hp_MN)
    M, N = x_hp_MN.shape
    out_MN = torch.empty((M, N), dtype=fp8_dtype, device=x_hp_MN.device)
    scale_M1 = torch.empty((M, 1), dtype=torch.float32, device=x_hp_MN.device)
    if M == 0:
        return out_MN, scale_M1
    BM, BN, one_tile = rowwise_tile(N)
    _launch(_rowwise_group_scaled_kernel)[(triton.cdiv(M, BM),)](
        # bf16 multipliers are read as they are (exact for the powers of two fp8.grouped passes; half the bytes)
        x_hp_MN, out_MN, scale_M1, (mul_GN if mul_GN.dtype == torch.bfloat16 else mul_GN.float()).contiguous(),
        gid_M.to(torch.int32).contiguous(), M, N,
        x_hp_MN.stride(0), x_hp_MN.stride(1), POW2=pow2, BM=BM, BN=BN, ONE_TILE=one_tile, num_warps=ROWWISE_WARPS,
        **_grid_consts(fp8_dtype))
    return out_MN, scale_M1


def cast_rows_transposed_batched_triton(
    x_hp_BRC: torch.Tensor, scale_BR: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """out_t [B, C, R] contiguous with out_t[b, c, r] = sat(x[b, r, c] * scale_BR[b, r]): a cast by given row scales,
    written transposed; x any strides (see reference.cast_rows_transposed_batched_ref)."""
    _require(x_hp_BRC)
    B, R, C = x_hp_BRC.shape
    out_t = torch.empty((B, C, R), dtype=fp8_dtype, device=x_hp_BRC.device)
    if B == 0 or R == 0 or C == 0:
        return out_t
    BR, BC = BATCHED_ROW_CAST_TILE
    _launch(_batched_row_scaled_cast_t_kernel)[(triton.cdiv(R, BR), triton.cdiv(C, BC), B)](
        x_hp_BRC, scale_BR.float().contiguous(), out_t, R, C, x_hp_BRC.stride(0), x_hp_BRC.stride(1),
        x_hp_BRC.stride(2), BR=BR, BC=BC, num_warps=TRANSPOSE_WARPS, **_grid_consts(fp8_dtype))
    return out_t


# (rows, columns) a program of the both-layouts row cast holds: BR rows make the transposed store's runs BR bytes
# long; not swept on the H200 yet (benchmarks/reuse_kernels.py sweeps it).
BATCHED_BOTH_LAYOUTS_TILE = (32, 128)
BATCHED_BOTH_LAYOUTS_WARPS = 4


def quantize_rows_and_transposed_batched_triton(
    x_hp_BRC: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_fp8 [B, R, C], scale_BR, x_fp8_t [B, C, R]), both contiguous, from one row-scaled cast of x (any strides):
    see reference.quantize_rows_and_transposed_batched_ref."""
    _require(x_hp_BRC)
    B, R, C = x_hp_BRC.shape
    dev = x_hp_BRC.device
    out = torch.empty((B, R, C), dtype=fp8_dtype, device=dev)
    out_t = torch.empty((B, C, R), dtype=fp8_dtype, device=dev)
    scale_BR = torch.empty((B, R), dtype=torch.float32, device=dev)
    if B == 0 or R == 0:
        return out, scale_BR, out_t
    if C == 0:  # empty rows: scales from the EPS floor, nothing to cast
        scale_BR.copy_(amax_to_scale(torch.zeros_like(scale_BR), fp8_dtype, pow2))
        return out, scale_BR, out_t
    BR, BC = BATCHED_BOTH_LAYOUTS_TILE
    _launch(_batched_rows_both_layouts_kernel)[(triton.cdiv(R, BR), B)](
        x_hp_BRC, out, out_t, scale_BR, R, C, x_hp_BRC.stride(0), x_hp_BRC.stride(1), x_hp_BRC.stride(2), POW2=pow2,
        BR=BR, BC=BC, num_warps=BATCHED_BOTH_LAYOUTS_WARPS, **_grid_consts(fp8_dtype))
    return out, scale_BR, out_t


def row_col_amax_triton(x_hp_MN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row amax [M] and column amax [N] (fp32) in one read of x."""
    _require(x_hp_MN)
    M, N = x_hp_MN.shape
    row_bits = torch.zeros(M, dtype=torch.int32, device=x_hp_MN.device)
    col_bits = torch.zeros(N, dtype=torch.int32, device=x_hp_MN.device)
    if M and N:
        BM, BN = ROW_COL_AMAX_TILE
        # Enough programs to fill the GPU (about 8 per SM on an H200) while each covers many columns, which
        # keeps the column atomics at N * ceil(M / BM).
        row_blocks = triton.cdiv(M, BM)
        splits = max(1, min(triton.cdiv(N, BN), triton.cdiv(1024, row_blocks)))
        n_per_prog = triton.cdiv(triton.cdiv(N, splits), BN) * BN
        grid = (row_blocks, triton.cdiv(N, n_per_prog))
        _launch(_row_col_amax_kernel)[grid](x_hp_MN, row_bits, col_bits, M, N, x_hp_MN.stride(0), x_hp_MN.stride(1),
                                   BM=BM, BN=BN, N_PER_PROG=n_per_prog, num_warps=ROW_COL_AMAX_WARPS)
    return row_bits.view(torch.float32), col_bits.view(torch.float32)


def quantize_rowwise_and_colwise_triton(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _require(x_hp_MN)
    M, N = x_hp_MN.shape
    dev = x_hp_MN.device
    row_out_MN = torch.empty((M, N), dtype=fp8_dtype, device=dev)
    col_out_t_NM = torch.empty((N, M), dtype=fp8_dtype, device=dev)
    scale_M1 = torch.empty((M, 1), dtype=torch.float32, device=dev)
    scale_1N = torch.empty((1, N), dtype=torch.float32, device=dev)
    row_amax_M, col_amax_N = row_col_amax_triton(x_hp_MN)
    if M == 0 or N == 0:
        # Degenerate shapes: nothing to cast; the scales of the rows/columns that exist come from the EPS floor.
        zeros_M1 = torch.zeros((M, 1), dtype=torch.float32, device=dev)
        zeros_1N = torch.zeros((1, N), dtype=torch.float32, device=dev)
        scale_M1, scale_1N = amax_to_scale(zeros_M1, fp8_dtype, pow2), amax_to_scale(zeros_1N, fp8_dtype, pow2)
        return row_out_MN, scale_M1, col_out_t_NM, scale_1N
    row_col_cast_into(x_hp_MN, row_amax_M, col_amax_N, fp8_dtype, pow2, row_out_MN, scale_M1, col_out_t_NM, scale_1N)
    return row_out_MN, scale_M1, col_out_t_NM, scale_1N


def row_col_cast_into(x_hp_MN, row_amax_M, col_amax_N, fp8_dtype, pow2, row_out_MN, scale_M1, col_out_t_NM, scale_1N):
    """The cast pass alone (given both amaxes), writing into preallocated outputs: one read of x, two writes."""
    M, N = x_hp_MN.shape
    BM, BN = ROW_COL_CAST_TILE
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _launch(_row_col_cast_kernel)[grid](x_hp_MN, row_out_MN, col_out_t_NM, row_amax_M, col_amax_N, scale_M1, scale_1N,
                               M, N, x_hp_MN.stride(0), x_hp_MN.stride(1), POW2=pow2, BM=BM, BN=BN,
                               num_warps=ROW_COL_WARPS, **_grid_consts(fp8_dtype))


TRANSPOSE_TILE = (128, 128)  # (BM, BN): 128-byte runs on both the fp8 read and the transposed write
TRANSPOSE_WARPS = 4
# (rows, columns) of the row-scaled transposed weight cast: a bf16 read in fp32 registers, so half the transpose's tile
# (the fused head's backward, the same read-compute-store-transposed shape, ran 128 x 128 tiles at 5.5 ms and
# 64 x 128 at 4.0 ms on the H200; not swept for this kernel)
BATCHED_ROW_CAST_TILE = (64, 128)


def transpose_triton(x_MN: torch.Tensor) -> torch.Tensor:
    """x_MN (any strides, any dtype) -> x^T as a contiguous [N, M] tensor, one tiled pass.

    For fp8 operands: torch._scaled_mm wants its left operand row-major and its right one column-major, so a
    tensorwise-scaled fp8 tensor needs a transposed copy for the backward GEMMs; as a separate kernel it keeps
    Inductor from fusing a strided byte-wide write into the cast (BENCHMARKS.md, session 3).
    """
    _require(x_MN)
    M, N = x_MN.shape
    out_t = torch.empty((N, M), dtype=x_MN.dtype, device=x_MN.device)
    if M == 0 or N == 0:
        return out_t
    BM, BN = TRANSPOSE_TILE
    # Bitcast 1-byte floats to int8: the kernel only moves bytes (no fp8 arithmetic, any fp8 format).
    src, dst = x_MN, out_t
    if x_MN.element_size() == 1:
        src, dst = x_MN.view(torch.int8), out_t.view(torch.int8)
    _launch(_transpose_kernel)[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        src, dst, M, N, x_MN.stride(0), x_MN.stride(1), BM=BM, BN=BN, num_warps=TRANSPOSE_WARPS)
    return out_t


def quantize_colwise_batched_triton(
    x_hp_BRC: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per batch, column-scaled along R, written transposed: (x_fp8_t [B, C, R] contiguous, scale [B, C]).

    Any strides (the [E, N, K] storage of expert weights is read in place): one read for the column amaxes, one
    read for the cast, one 1-byte write; no transposed copy of the high-precision tensor.
    """
    _require(x_hp_BRC)
    B, R, C = x_hp_BRC.shape
    dev = x_hp_BRC.device
    out_t = torch.empty((B, C, R), dtype=fp8_dtype, device=dev)
    scale_BC = torch.empty((B, C), dtype=torch.float32, device=dev)
    amax_bits_BC = torch.zeros((B, C), dtype=torch.int32, device=dev)
    if B == 0 or C == 0:
        return out_t, scale_BC
    strides = (x_hp_BRC.stride(0), x_hp_BRC.stride(1), x_hp_BRC.stride(2))
    BR, BC = ROW_COL_AMAX_TILE  # (rows, columns) as in the 2D row+column amax pass
    # Split the rows only when batches x column blocks leave the GPU under-filled (about 1024 programs on an H200).
    col_blocks = triton.cdiv(C, BC)
    splits = max(1, min(triton.cdiv(max(R, 1), BR), triton.cdiv(1024, B * col_blocks)))
    r_per_prog = triton.cdiv(triton.cdiv(max(R, 1), splits), BR) * BR
    _launch(_batched_col_amax_kernel)[(col_blocks, triton.cdiv(max(R, 1), r_per_prog), B)](
        x_hp_BRC, amax_bits_BC, R, C, *strides, BR=BR, BC=BC, R_PER_PROG=r_per_prog, num_warps=ROW_COL_AMAX_WARPS)
    BR, BC = ROW_COL_CAST_TILE
    _launch(_batched_col_cast_t_kernel)[(max(1, triton.cdiv(R, BR)), triton.cdiv(C, BC), B)](
        x_hp_BRC, amax_bits_BC.view(torch.float32), out_t, scale_BC, R, C, *strides, POW2=pow2, BR=BR, BC=BC,
        num_warps=ROW_COL_WARPS, **_grid_consts(fp8_dtype))
    return out_t, scale_BC


def quantize_jagged_per_expert_triton(
    x_hp_MK: torch.Tensor,
    offs_E: torch.Tensor,
    fp8_dtype: torch.dtype,
    pow2: bool = True,
    transpose_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    _require(x_hp_MK)
    M, K = x_hp_MK.shape
    E = offs_E.shape[0]
    dev = x_hp_MK.device
    out = torch.empty((K, M) if transpose_out else (M, K), dtype=fp8_dtype, device=dev)
    scale_EK = torch.empty((E, K), dtype=torch.float32, device=dev)
    if K == 0 or M == 0 or E == 0:
        # Nothing to cast (E == 0: every row is past the last group, so zeros); scales from the EPS floor.
        scale_EK.copy_(amax_to_scale(torch.zeros_like(scale_EK), fp8_dtype, pow2))
        return out.zero_(), scale_EK
    amax_bits_EK = torch.zeros((E, K), dtype=torch.int32, device=dev)
    BM, BK = JAGGED_TILE
    CH = max(JAGGED_CHUNK, BM)
    # Upper bound on the chunks (see _jagged_chunk); programs past the real count exit at once.
    grid = (triton.cdiv(K, BK), triton.cdiv(M, CH) + 2 * (E + 1))
    E_POW2 = triton.next_power_of_2(E + 1)
    strides = (x_hp_MK.stride(0), x_hp_MK.stride(1))
    _launch(_jagged_amax_kernel)[grid](x_hp_MK, offs_E, amax_bits_EK, M, K, *strides, E, BM=BM, BK=BK, CH=CH,
                                       E_POW2=E_POW2, num_warps=JAGGED_WARPS)
    _launch(_jagged_cast_kernel)[grid](x_hp_MK, offs_E, amax_bits_EK.view(torch.float32), out, scale_EK, M, K,
                                       *strides, E, POW2=pow2, BM=BM, BK=BK, CH=CH, E_POW2=E_POW2,
                                       TRANSPOSE_OUT=transpose_out, num_warps=JAGGED_WARPS, **_grid_consts(fp8_dtype))
    return out, scale_EK


HEALTH_TILE = (64, 128)  # (BR, BC): the <= 127 sampled rows in one or two row blocks
HEALTH_SCALE_BLOCK = 4096
HEALTH_WARPS = 8


def health_stats_triton(
    x_hp_MK: torch.Tensor, x_fp8_MK: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """reference.health_stats_ref in one launch. scale: one value, or one per row of x (contiguous, fp32)."""
    _require(x_hp_MK)
    M, N = x_hp_MK.shape
    if x_hp_MK.numel() == 0:
        return torch.zeros(3, dtype=torch.float32, device=x_hp_MK.device)
    if scale.numel() not in (1, M) or scale.dtype != torch.float32:
        raise ValueError(f"health_stats wants one fp32 scale or one per row ({M}), got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    scale = scale.contiguous()
    step = health_sample_step(M)
    n_rows = triton.cdiv(M, step)
    out = torch.empty(3, dtype=torch.float32, device=x_hp_MK.device)
    BR, BC = HEALTH_TILE
    scale_row_stride = 1 if scale.numel() == M and M > 1 else 0
    _launch(_health_kernel)[(2,)](
        x_hp_MK, x_fp8_MK, scale, out, N, step, n_rows, scale.numel(), float(n_rows * N), x_hp_MK.stride(0),
        x_hp_MK.stride(1),
        x_fp8_MK.stride(0), x_fp8_MK.stride(1), scale_row_stride, CLIP=health_clip_limit(fp8_dtype),
        FP8_MAX=fp8_max(fp8_dtype), BR=BR, BC=BC, BS=HEALTH_SCALE_BLOCK, num_warps=HEALTH_WARPS)
    return out
