"""Triton kernels that write fp8 data transposed: the fp8 transpose, plain or batched (torch._scaled_mm's operand
layouts; the MoE experts' fp8 weights in the grad-input GEMM's layout), and the batched cast of expert weights by
given row scales into that layout; their launchers.

Each matches fp8/reference.py (the transpose: x.transpose(-2, -1).contiguous()). Shape legend: B batches (experts),
M rows, N columns; R rows, C columns of a batch; BM/BN/BR/BC tile sizes.
"""

from __future__ import annotations

import torch

from .triton_fp8 import HAS_TRITON, grid_consts, launch, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_fp8 import _to_fp8

    @triton.jit
    def _transpose_kernel(x_ptr, out_t_ptr, M, N, stride_xb, stride_xm, stride_xn, BM: tl.constexpr,
                          BN: tl.constexpr):
        # Tile [BM, BN] of batch b read along N, stored transposed into batch b of the [B, N, M] contiguous output
        # (runs of BM elements).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x = tl.load(x_ptr + b * stride_xb + offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :] * stride_xn,
                    mask=mask_m[:, None] & mask_n[None, :])
        tl.store(out_t_ptr + b * M * N + offs_n.to(tl.int64)[:, None] * M + offs_m[None, :], tl.trans(x),
                 mask=mask_n[:, None] & mask_m[None, :])

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


TRANSPOSE_TILE = (128, 128)  # (BM, BN): 128-byte runs on both the fp8 read and the transposed write
TRANSPOSE_WARPS = 4
# (rows, columns) of the row-scaled transposed weight cast: a bf16 read in fp32 registers, so half the transpose's tile
# (the fused head's backward, the same read-compute-store-transposed shape, was faster at 64 x 128 than at 128 x 128
# in benchmarks/ce_head.py; not swept for this kernel)
BATCHED_ROW_CAST_TILE = (64, 128)


def transpose_triton(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] or [B, M, N] (any strides, any dtype) -> its last two dims swapped, contiguous ([N, M] or
    [B, N, M]), one tiled pass.

    For fp8 operands: torch._scaled_mm wants its left operand row-major and its right one column-major, so a
    tensorwise-scaled fp8 tensor needs a transposed copy for the backward GEMMs; as a separate kernel it keeps
    Inductor from fusing a strided byte-wide write into the cast, which made the dense step slower (BENCHMARKS.md,
    "Tried, did not pay"). Batched: the MoE experts' fp8 weights in the grad-input GEMM's layout (fp8.grouped).
    """
    require_triton(x)
    x_BMN = x if x.dim() == 3 else x.unsqueeze(0)
    B, M, N = x_BMN.shape
    out_t = torch.empty((B, N, M), dtype=x.dtype, device=x.device)
    if B > 0 and M > 0 and N > 0:
        BM, BN = TRANSPOSE_TILE
        # Bitcast 1-byte floats to int8: the kernel only moves bytes (no fp8 arithmetic, any fp8 format).
        src, dst = x_BMN, out_t
        if x.element_size() == 1:
            src, dst = x_BMN.view(torch.int8), out_t.view(torch.int8)
        launch(_transpose_kernel)[(triton.cdiv(M, BM), triton.cdiv(N, BN), B)](
            src, dst, M, N, x_BMN.stride(0), x_BMN.stride(1), x_BMN.stride(2), BM=BM, BN=BN,
            num_warps=TRANSPOSE_WARPS)
    return out_t if x.dim() == 3 else out_t.squeeze(0)


def cast_rows_transposed_batched_triton(
    x_hp_BRC: torch.Tensor, scale_BR: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """out_t [B, C, R] contiguous with out_t[b, c, r] = sat(x[b, r, c] * scale_BR[b, r]): a cast by given row scales,
    written transposed; x any strides (see fp8.reference.cast_rows_transposed_batched_ref)."""
    require_triton(x_hp_BRC)
    B, R, C = x_hp_BRC.shape
    out_t = torch.empty((B, C, R), dtype=fp8_dtype, device=x_hp_BRC.device)
    if B == 0 or R == 0 or C == 0:
        return out_t
    BR, BC = BATCHED_ROW_CAST_TILE
    launch(_batched_row_scaled_cast_t_kernel)[(triton.cdiv(R, BR), triton.cdiv(C, BC), B)](
        x_hp_BRC, scale_BR.float().contiguous(), out_t, R, C, x_hp_BRC.stride(0), x_hp_BRC.stride(1),
        x_hp_BRC.stride(2), BR=BR, BC=BC, num_warps=TRANSPOSE_WARPS, **grid_consts(fp8_dtype))
    return out_t
