"""Triton cast kernels around the FP8 GEMMs (tensorwise, rowwise, rowwise with per-group multipliers, rowwise +
colwise), and their launchers.

Each kernel matches a function of fp8/reference.py bit for bit (same scale formula, same saturating
round-to-nearest-even cast; the shared pieces are in triton_fp8.py). The launchers take and return torch tensors;
`ops.py` wraps them as torch.library Triton ops.

Kernels (all memory-bound: the work is one or two reads of x and one write per fp8 output):
- tensorwise: `_amax_kernel` (read x, one atomic per block) then `_cast_tensorwise_kernel` (read x, write fp8;
  the scale is computed in-kernel from the amax, so no scale kernel). With a given amax only the cast runs.
- rowwise: `_rowwise_kernel`, one read of x: a program holds BM whole rows in registers when N fits one tile,
  else it loops over N twice (the second loop mostly hits L2). `_rowwise_group_scaled_kernel` is the same cast of
  x * mul[group of the row, :].
- rowwise + colwise: `_row_col_amax_kernel` (one read, row and column amax merged with relaxed int32 atomics)
  then `_row_col_cast_kernel` (one read, writes the row-scaled fp8 row-major and the column-scaled fp8 transposed).
  Column scales need every row, so two reads of x is the floor for full-column scales.

Why no triton.autotune: the autotuner re-runs a kernel many times on the first call of each key (the tensorwise
amax kernel accumulates with atomics, so it would need reset hooks), and the interpreter would benchmark too.
The launchers pick block sizes with small heuristics from benchmarks/fp8_kernels.py's sweeps of the candidates
(BENCHMARKS.md, "Cast kernels vs copy bandwidth"); the autotune key would be (N, or K) plus the input dtype, since the tile shape depends only on the
row length and element size, not on M (M only changes the grid).

Shape legend: M rows, N (or K) columns; BM/BN tile sizes.
"""

from __future__ import annotations

import torch

from fp8.reference import amax_to_scale

from .triton_fp8 import HAS_TRITON, grid_consts, launch, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_fp8 import _abs_max, _max_nan, _scale_from_amax, _to_fp8

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


# Tile heuristics (the would-be autotune key: row length N/K and element size; see module docstring).
TENSORWISE_BLOCK = 8192  # elements per program: 16 KB of bf16, 8 warps -> 32 elements a thread
# benchmarks/fp8_kernels.py's sweep: 8192-element tiles were best for rows of 2048 and 4096, whole 16384-padded rows
# best for 14336 (against 8192 and a loop).
ROWWISE_MAX_TILE = 8192  # elements a program holds in registers (BM * BN) when several rows share a program
ROWWISE_MAX_ROW = 16384  # longest (padded) row kept whole in registers; longer rows loop over BN = ROWWISE_MAX_TILE
# (128, 64) beat (64, 128) on the whole rowwise+colwise op (the same sweep): half the column atomics.
ROW_COL_AMAX_TILE = (128, 64)  # (BM, BN) of the amax pass
ROW_COL_CAST_TILE = (64, 128)  # (BM, BN) of the cast pass
TENSORWISE_WARPS = 8
ROWWISE_WARPS = 8
ROW_COL_AMAX_WARPS = 8
ROW_COL_WARPS = 8


def tensorwise_amax(x_hp: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor, on device (no host sync)."""
    require_triton(x_hp)
    x_flat = x_hp.contiguous().view(-1)
    amax_bits = torch.zeros(1, dtype=torch.int32, device=x_hp.device)
    numel = x_flat.numel()
    grid = (max(1, triton.cdiv(numel, TENSORWISE_BLOCK)),)
    launch(_amax_kernel)[grid](x_flat, amax_bits, numel, BLOCK=TENSORWISE_BLOCK, num_warps=TENSORWISE_WARPS)
    return amax_bits.view(torch.float32).reshape(())


def quantize_tensorwise_triton(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(x_hp)
    if amax is None:
        amax = tensorwise_amax(x_hp)
    amax = amax.reshape(1).to(device=x_hp.device, dtype=torch.float32)
    x_flat = x_hp.contiguous().view(-1)
    out = torch.empty(x_hp.shape, dtype=fp8_dtype, device=x_hp.device)
    scale = torch.empty((), dtype=torch.float32, device=x_hp.device)
    numel = x_flat.numel()
    grid = (max(1, triton.cdiv(numel, TENSORWISE_BLOCK)),)
    launch(_cast_tensorwise_kernel)[grid](x_flat, out.view(-1), amax, scale, numel, BLOCK=TENSORWISE_BLOCK,
                                  num_warps=TENSORWISE_WARPS, **grid_consts(fp8_dtype))
    return out, scale


def rowwise_tile(N: int, max_tile: int | None = None) -> tuple[int, int, bool]:
    """(BM, BN, one_tile) for rows of N elements: whole rows in registers when a row fits max_tile."""
    max_tile = ROWWISE_MAX_TILE if max_tile is None else max_tile
    BN = triton.next_power_of_2(max(N, 1))
    if BN <= max(max_tile, ROWWISE_MAX_ROW):
        return max(1, min(max_tile // BN, 64)), BN, True
    return 1, max_tile, False


def _rowwise_outputs(x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype):
    """(M, N, out_MN, scale_M1): the uninitialised results of a row cast of x."""
    require_triton(x_hp_MN)
    M, N = x_hp_MN.shape
    out_MN = torch.empty((M, N), dtype=fp8_dtype, device=x_hp_MN.device)
    scale_M1 = torch.empty((M, 1), dtype=torch.float32, device=x_hp_MN.device)
    return M, N, out_MN, scale_M1


def quantize_rowwise_triton(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    M, N, out_MN, scale_M1 = _rowwise_outputs(x_hp_MN, fp8_dtype)
    if M == 0:
        return out_MN, scale_M1
    BM, BN, one_tile = rowwise_tile(N)
    grid = (triton.cdiv(M, BM),)
    launch(_rowwise_kernel)[grid](x_hp_MN, out_MN, scale_M1, M, N, x_hp_MN.stride(0), x_hp_MN.stride(1), POW2=pow2,
                          BM=BM, BN=BN, ONE_TILE=one_tile, num_warps=ROWWISE_WARPS, **grid_consts(fp8_dtype))
    return out_MN, scale_M1


def quantize_rowwise_group_scaled_triton(
    x_hp_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise quantization of y = x * mul_GN[gid_M[m], :] in one read of x (see reference)."""
    M, N, out_MN, scale_M1 = _rowwise_outputs(x_hp_MN, fp8_dtype)
    if M == 0:
        return out_MN, scale_M1
    BM, BN, one_tile = rowwise_tile(N)
    launch(_rowwise_group_scaled_kernel)[(triton.cdiv(M, BM),)](
        # bf16 multipliers are read as they are (exact for the powers of two fp8.grouped passes; half the bytes)
        x_hp_MN, out_MN, scale_M1, (mul_GN if mul_GN.dtype == torch.bfloat16 else mul_GN.float()).contiguous(),
        gid_M.to(torch.int32).contiguous(), M, N,
        x_hp_MN.stride(0), x_hp_MN.stride(1), POW2=pow2, BM=BM, BN=BN, ONE_TILE=one_tile, num_warps=ROWWISE_WARPS,
        **grid_consts(fp8_dtype))
    return out_MN, scale_M1



def row_col_amax_triton(x_hp_MN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row amax [M] and column amax [N] (fp32) in one read of x."""
    require_triton(x_hp_MN)
    M, N = x_hp_MN.shape
    row_bits = torch.zeros(M, dtype=torch.int32, device=x_hp_MN.device)
    col_bits = torch.zeros(N, dtype=torch.int32, device=x_hp_MN.device)
    if M and N:
        BM, BN = ROW_COL_AMAX_TILE
        # Enough programs to fill the GPU (several per SM on a Hopper GPU) while each covers many columns, which
        # keeps the column atomics at N * ceil(M / BM).
        row_blocks = triton.cdiv(M, BM)
        splits = max(1, min(triton.cdiv(N, BN), triton.cdiv(1024, row_blocks)))
        n_per_prog = triton.cdiv(triton.cdiv(N, splits), BN) * BN
        grid = (row_blocks, triton.cdiv(N, n_per_prog))
        launch(_row_col_amax_kernel)[grid](x_hp_MN, row_bits, col_bits, M, N, x_hp_MN.stride(0), x_hp_MN.stride(1),
                                   BM=BM, BN=BN, N_PER_PROG=n_per_prog, num_warps=ROW_COL_AMAX_WARPS)
    return row_bits.view(torch.float32), col_bits.view(torch.float32)


def quantize_rowwise_and_colwise_triton(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    require_triton(x_hp_MN)
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
    launch(_row_col_cast_kernel)[grid](x_hp_MN, row_out_MN, col_out_t_NM, row_amax_M, col_amax_N, scale_M1, scale_1N,
                                      M, N, x_hp_MN.stride(0), x_hp_MN.stride(1), POW2=pow2, BM=BM, BN=BN,
                               num_warps=ROW_COL_WARPS, **grid_consts(fp8_dtype))
