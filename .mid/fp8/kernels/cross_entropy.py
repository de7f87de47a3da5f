"""Triton kernels of the fused FP8 output head's loss: token cross-entropy whose backward writes the fp8 gradient.

An FP8 LM head's backward needs the logits' gradient g = (softmax(logits) - onehot(target)) * coef quantized, in two
layouts: row-major [M, V] for the grad-input GEMM and transposed [V, M] for the grad-weight GEMM (torch._scaled_mm
contracts over contiguous dims only). Unfused, that gradient is the largest tensor of a step (16384 tokens x 102400
vocab = 3.4 GB in bf16) and is moved five times: the loss backward writes it, an amax pass and a cast pass read it,
a transpose reads and writes the fp8 copy. Fused:

- `_ce_fwd_kernel`, one program per row: online max / sum-exp over the row -> lse, the row's loss (lse - logit of the
  target) and the row's largest |p - onehot| = max(max over non-targets of p, 1 - p_target). The tensor's gradient
  amax is therefore known after the forward, with no pass over g.
- `_ce_bwd_cast_kernel`, one program per [BM, BV] tile: recomputes p from the saved logits and lse, forms g, scales it
  by fp8_max / amax (computed in-kernel from the forward's row maxima times |coef|) and stores the fp8 tile row-major,
  and transposed too where CE_BWD_FUSED_T (else one transpose pass over the fp8 gradient makes that copy: faster,
  see the tiles below). Traffic: one read of the bf16 logits and two 1-byte writes (plus a 1-byte read and
  write for the separate transpose), where the unfused path moves ~5.5x that.

Numerics: g is formed in fp32 from bf16 logits (as F.cross_entropy on upcast logits) and quantized from fp32 (the
unfused path rounds it to bf16 first); the scale is the dynamic tensorwise scale of g's exact amax. The references
(fp8.reference.cross_entropy_fwd_ref, cross_entropy_grad_cast_ref) define every output.

Legend: M rows (tokens), V vocabulary; BM, BV tile sizes.
"""

from __future__ import annotations

import torch

from .transposed import transpose_triton
from .triton_fp8 import HAS_TRITON, grid_consts, launch, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_fp8 import _scale_from_amax, _to_fp8

    @triton.jit
    def _ce_fwd_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, gamax_ptr, M, V, stride_lm,
                       IGNORE_INDEX: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, EVEN: tl.constexpr):
        # BM rows per program, streamed in [BM, BV] tiles with a running max / sum-exp per row (online softmax).
        # Per element only what lse needs (a max and a sum-exp: two reductions a tile). The target's logit is one
        # load per row, and the max over non-target columns differs from the tile's max only in the tile that holds
        # a row's target, so the masked max runs there only (a branch taken in about BM of V / BV tiles).
        # EVEN: BM divides M and BV divides V, so no masks (they keep loads and stores from vectorizing fully).
        NEG_INF: tl.constexpr = float("-inf")
        LOG2E: tl.constexpr = 1.4426950408889634
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        mask_m = offs_m < M
        if EVEN:
            t = tl.load(targets_ptr + offs_m).to(tl.int64)
        else:
            t = tl.load(targets_ptr + offs_m, mask=mask_m, other=IGNORE_INDEX).to(tl.int64)
        valid = t != IGNORE_INDEX
        rows = logits_ptr + offs_m.to(tl.int64)[:, None] * stride_lm
        # the target's logit (ignored rows read column 0, then discard it; an id outside [0, V) - which the head
        # refuses on the device before this runs - reads a column of its own row, never out of bounds)
        t_col = tl.minimum(tl.maximum(tl.where(valid, t, 0), 0), V - 1)
        x_t = tl.load(rows + t_col[:, None], mask=mask_m[:, None], other=0.0).to(tl.float32)
        x_t = tl.sum(x_t, 1)
        m = tl.full([BM], NEG_INF, tl.float32)  # running max over all columns (for lse)
        m_other = tl.full([BM], NEG_INF, tl.float32)  # running max over the non-target columns
        s = tl.zeros([BM], dtype=tl.float32)  # running sum of exp(x - m)
        for v0 in range(0, V, BV):
            offs_v = v0 + tl.arange(0, BV)
            if EVEN:
                x = tl.load(rows + offs_v[None, :]).to(tl.float32)
            else:
                mask = mask_m[:, None] & (offs_v < V)[None, :]
                x = tl.load(rows + offs_v[None, :], mask=mask, other=NEG_INF).to(tl.float32)
            tile_max = tl.max(x, 1)
            m_new = tl.maximum(m, tile_max)
            # rows past M (all -inf) keep s = 0: exp(-inf - -inf) would be NaN. exp(d) = exp2(d * log2(e)), the
            # difference formed first: x * log2(e) - m * log2(e) in one multiply-add loses |x| * 2**-24 of the
            # exponent (a 40-unit logit: p off by ~2e-6 relative, which p - 1 of a well-predicted target magnifies).
            alpha = tl.where(m_new == NEG_INF, 0.0, tl.exp2((m - m_new) * LOG2E))
            # a row whose columns so far are all -inf (masked vocabulary padding, rows past M): its terms are 0
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            e = tl.exp2((x - m_safe[:, None]) * LOG2E)
            if not EVEN:
                e = tl.where(mask, e, 0.0)
            s = s * alpha + tl.sum(e, 1)
            m = m_new
            hit = (t >= v0) & (t < v0 + BV)
            if tl.max(hit.to(tl.int32), 0) > 0:
                other = tl.max(tl.where(offs_v[None, :] == t[:, None], NEG_INF, x), 1)
                m_other = tl.maximum(m_other, tl.where(hit, other, tile_max))
            else:
                m_other = tl.maximum(m_other, tile_max)
        lse = m + tl.log(s)
        tl.store(lse_ptr + offs_m, lse, mask=mask_m)
        tl.store(loss_ptr + offs_m, tl.where(valid, lse - x_t, 0.0), mask=mask_m)
        # The same expressions the backward kernel evaluates for these two elements (same fp32 operations).
        g_max = tl.maximum(tl.exp2((m_other - lse) * LOG2E), 1.0 - tl.exp2((x_t - lse) * LOG2E))
        tl.store(gamax_ptr + offs_m, tl.where(valid, g_max, 0.0), mask=mask_m)

    @triton.jit
    def _ce_bwd_cast_kernel(logits_ptr, targets_ptr, lse_ptr, gamax_ptr, coef_ptr, g_ptr, g_t_ptr, scale_ptr,
                            M, V, stride_lm,
                            IGNORE_INDEX: tl.constexpr, FP8_MAX: tl.constexpr, EPS_: tl.constexpr,
                            BM: tl.constexpr, BV: tl.constexpr, OUT_DTYPE: tl.constexpr, EVEN: tl.constexpr,
                            WRITE_T: tl.constexpr,
                            EXACT_ROUND: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                            SUB_MAGIC: tl.constexpr, NAN_BITS: tl.constexpr):
        # WRITE_T: also store the tile transposed into g_t (else the caller transposes g in a separate pass).
        LOG2E: tl.constexpr = 1.4426950408889634
        pid_m = tl.program_id(0)
        pid_v = tl.program_id(1)
        coef = tl.load(coef_ptr).to(tl.float32)
        scale = _scale_from_amax(tl.load(gamax_ptr) * tl.abs(coef), FP8_MAX, EPS_, False)
        if (pid_m == 0) & (pid_v == 0):
            tl.store(scale_ptr, scale)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_v = pid_v * BV + tl.arange(0, BV)
        mask_m = offs_m < M
        mask_v = offs_v < V
        mask = mask_m[:, None] & mask_v[None, :]
        rows64 = offs_m.to(tl.int64)
        if EVEN:
            x = tl.load(logits_ptr + rows64[:, None] * stride_lm + offs_v[None, :]).to(tl.float32)
            lse = tl.load(lse_ptr + offs_m)
            t = tl.load(targets_ptr + offs_m).to(tl.int64)
        else:
            x = tl.load(logits_ptr + rows64[:, None] * stride_lm + offs_v[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            lse = tl.load(lse_ptr + offs_m, mask=mask_m, other=0.0)
            t = tl.load(targets_ptr + offs_m, mask=mask_m, other=IGNORE_INDEX).to(tl.int64)
        p = tl.exp2((x - lse[:, None]) * LOG2E)  # as the forward's g_max (see there why not a multiply-add)
        g = tl.where(offs_v[None, :] == t[:, None], p - 1.0, p)
        row_coef = tl.where(t != IGNORE_INDEX, coef * scale, 0.0)
        y = _to_fp8(g * row_coef[:, None], OUT_DTYPE, FP8_MAX, EXACT_ROUND, MBITS, MIN_NORMAL, SUB_MAGIC, NAN_BITS)
        # the outputs are int8 views: move bytes (the transposed store's layout change is byte-wise)
        y = y.to(tl.int8, bitcast=True)
        if EVEN:
            tl.store(g_ptr + rows64[:, None] * V + offs_v[None, :], y)
            if WRITE_T:
                tl.store(g_t_ptr + offs_v.to(tl.int64)[:, None] * M + offs_m[None, :], tl.trans(y))
        else:
            tl.store(g_ptr + rows64[:, None] * V + offs_v[None, :], y, mask=mask)
            if WRITE_T:
                tl.store(g_t_ptr + offs_v.to(tl.int64)[:, None] * M + offs_m[None, :], tl.trans(y),
                         mask=mask_v[:, None] & mask_m[None, :])


# Tiles, the fastest of two sweeps of benchmarks/ce_head.py (16384 x 102400 bf16 logits; its result file has the
# table). Forward: one row per program, 1024-column tiles, 2 warps, near the bandwidth of its least traffic; more
# rows per program were slower, and so was a kernel with four reductions a tile (max, sum-exp, the non-target max,
# the target's logit). Backward: 8 x 1024 tiles, 4 warps, the transposed copy by a separate transpose pass: storing
# the transposed tile from the kernel was slower at every tile tried.
CE_FWD_TILE = (1, 1024)  # (BM rows, BV columns) per program
CE_FWD_WARPS = 2
CE_BWD_TILE = (8, 1024)
CE_BWD_WARPS = 4
# Whether the backward kernel also stores the transposed tile (True) or the transpose is a separate pass over the
# fp8 gradient (fp8.kernels.transposed.transpose_triton, 128 x 128 byte tiles; one more read and write of 1 byte).
CE_BWD_FUSED_T = False

_TL_FP8 = {}


def _tl_dtype(fp8_dtype: torch.dtype):
    if not _TL_FP8:
        _TL_FP8.update({torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5,
                        torch.float8_e4m3fnuz: tl.float8e4b8, torch.float8_e5m2fnuz: tl.float8e5b16})
    return _TL_FP8[fp8_dtype]


def _check(logits_MV: torch.Tensor, targets_M: torch.Tensor) -> None:
    require_triton(logits_MV)
    if logits_MV.dim() != 2 or logits_MV.stride(1) != 1:
        raise ValueError(f"cross-entropy kernels need [M, V] logits with contiguous rows, got shape "
                         f"{tuple(logits_MV.shape)} strides {logits_MV.stride()}")
    if targets_M.shape != (logits_MV.shape[0],):
        raise ValueError(f"targets shape {tuple(targets_M.shape)} does not match logits' rows {logits_MV.shape[0]}")


def cross_entropy_fwd_triton(
    logits_MV: torch.Tensor, targets_M: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (lse_M, loss_M, gamax_M) fp32: see fp8.reference.cross_entropy_fwd_ref."""
    _check(logits_MV, targets_M)
    M, V = logits_MV.shape
    if V == 0:
        raise ValueError("cross-entropy over an empty vocabulary (logits of shape [M, 0])")
    lse, loss, gamax = (torch.empty(M, dtype=torch.float32, device=logits_MV.device) for _ in range(3))
    if M == 0:
        return lse, loss, gamax
    BM, BV = CE_FWD_TILE
    launch(_ce_fwd_kernel)[(triton.cdiv(M, BM),)](
        logits_MV, targets_M.contiguous(), lse, loss, gamax, M, V, logits_MV.stride(0), IGNORE_INDEX=ignore_index,
        BM=BM, BV=BV, EVEN=(M % BM == 0 and V % BV == 0), num_warps=CE_FWD_WARPS)
    return lse, loss, gamax


def cross_entropy_grad_cast_triton(
    logits_MV: torch.Tensor, targets_M: torch.Tensor, lse_M: torch.Tensor, gamax: torch.Tensor, coef: torch.Tensor,
    fp8_dtype: torch.dtype, ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (g_fp8_MV row-major, g_fp8_t_VM = its transpose, contiguous, scale 0-d fp32): see
    fp8.reference.cross_entropy_grad_cast_ref. gamax: 0-d, the max of the forward's row maxima; coef: 0-d."""
    _check(logits_MV, targets_M)
    M, V = logits_MV.shape
    if V == 0:
        raise ValueError("cross-entropy over an empty vocabulary (logits of shape [M, 0])")
    dev = logits_MV.device
    fused_t = CE_BWD_FUSED_T
    g = torch.empty((M, V), dtype=fp8_dtype, device=dev)
    g_t = torch.empty((V, M) if fused_t else (0,), dtype=fp8_dtype, device=dev)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    BM, BV = CE_BWD_TILE
    grid = (max(1, triton.cdiv(M, BM)), max(1, triton.cdiv(V, BV)))
    launch(_ce_bwd_cast_kernel)[grid](
        logits_MV, targets_M.contiguous(), lse_M, gamax.reshape(1).float(), coef.reshape(1).float(),
        g.view(torch.int8), g_t.view(torch.int8), scale, M, V, logits_MV.stride(0), IGNORE_INDEX=ignore_index,
        # no rows: the one program launched (it writes the scale) must take the masked path
        BM=BM, BV=BV, OUT_DTYPE=_tl_dtype(fp8_dtype), EVEN=(M > 0 and M % BM == 0 and V % BV == 0), WRITE_T=fused_t,
        num_warps=CE_BWD_WARPS, **grid_consts(fp8_dtype))
    if not fused_t:
        g_t = transpose_triton(g)
    return g, g_t, scale
