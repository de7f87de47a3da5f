"""The Triton fp8 transpose, plain or batched (torch._scaled_mm's operand layouts; the MoE experts' fp8 weights in
the grad-input GEMM's layout), and its launcher.

It matches fp8/reference.py's transpose_ref (x.transpose(-2, -1).contiguous()) byte for byte. Shape legend: B batches
(experts), M rows, N columns; BM/BN tile sizes.
"""

from __future__ import annotations

import torch

from .triton_fp8 import HAS_TRITON, launch, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

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


TRANSPOSE_TILE = (128, 128)  # (BM, BN): 128-byte runs on both the fp8 read and the transposed write
TRANSPOSE_WARPS = 4


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
