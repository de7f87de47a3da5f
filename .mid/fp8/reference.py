"""The FP8 quantization reference: pure PyTorch, any device, torch.compile friendly. The one definition of the numerics.

The emulated FP8 path (fp8.quant off the GPU, and wherever a kernel is unavailable) runs these functions; the Triton
kernels in fp8/kernels must match them bit for bit (tests/test_fp8_kernels.py in the interpreter,
tests/test_fp8_gpu.py on a GPU). fp8.quant.CASTS pairs each kernel with its reference here.

Conventions shared by every function here and in the kernels:
- `scale` multiplies: x_fp8 = saturate(x_hp * scale), dequant x_hp ~= x_fp8 / scale. torch._scaled_mm wants the
  dequant multiplier, i.e. `scale.reciprocal()` (exact when the scale is a power of two).
- scale = fp8_max / max(amax, EPS) in fp32. EPS keeps all-zero rows, columns and empty expert groups finite.
- pow2=True rounds the scale down to a power of two by clearing its mantissa bits, so |x| * scale <= fp8_max still
  holds and the dequant is exact in any precision (DeepSeek-V3 / torchao rowwise recipe).
- The cast saturates: values are clamped to [-fp8_max, fp8_max] before the round-to-nearest-even cast.
- NaN anywhere in a row / column / group / tensor makes its amax and scale NaN and so all of its quantized data
  NaN (loud on purpose: the divergence monitors must see it). An inf input gives scale 0 and NaN where the inf was.

Shape legend: M rows (tokens), N (or K) columns (features), E expert groups, V vocabulary; suffix _t = transposed.
"""

from __future__ import annotations

import torch

# Same floor as torchao's float8 code: 448 / 1e-12 = 4.5e14 stays far below the fp32 max.
EPS = 1e-12

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def check_fp8_dtype(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value: e4m3fn 448, e5m2 57344, e4m3fnuz 240, e5m2fnuz 57344."""
    check_fp8_dtype(fp8_dtype)
    return float(torch.finfo(fp8_dtype).max)


def pow2_floor(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales down to a power of two by clearing the mantissa bits (exact, no log2).

    NaN stays NaN (clearing its mantissa would turn it into inf and hide the NaN input behind it).
    """
    bits = scale.contiguous().view(torch.int32) & 0x7F800000
    return torch.where(scale.isnan(), scale, bits.view(torch.float32).view(scale.shape))


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """fp32 scale = fp8_max / max(amax, EPS), optionally rounded down to a power of two."""
    amax = amax.float().clamp(min=EPS)
    # tensor / tensor: `python_float / tensor` runs reciprocal-then-multiply, which can be one ulp off the IEEE
    # quotient that the Triton kernels compute.
    scale = torch.full_like(amax, fp8_max(fp8_dtype)) / amax
    return pow2_floor(scale) if pow2 else scale


def saturated_cast(x_hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) cast to fp8 with round-to-nearest-even; scale broadcasts against x."""
    limit = fp8_max(fp8_dtype)
    return (x_hp.float() * scale).clamp(-limit, limit).to(fp8_dtype)


def abs_amax(x_hp: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """max |x| in fp32 over `dim` (all dims when None); 0 over an empty dim instead of torch's error."""
    abs_x = x_hp.detach().abs()  # amax is exact in the input dtype: upcast only the result
    if dim is None:
        return abs_x.amax().float() if abs_x.numel() else abs_x.new_zeros((), dtype=torch.float32)
    if abs_x.shape[dim] == 0:
        shape = list(abs_x.shape)
        if keepdim:
            shape[dim] = 1
        else:
            del shape[dim]
        return abs_x.new_zeros(shape, dtype=torch.float32)
    return abs_x.amax(dim=dim, keepdim=keepdim).float()


def check_2d_high_precision(x_hp: torch.Tensor, name: str) -> None:
    if x_hp.dim() != 2:
        raise ValueError(f"{name} expects a 2D tensor [M, N], got shape {tuple(x_hp.shape)}; reshape first")
    if not x_hp.is_floating_point() or x_hp.dtype in FP8_DTYPES:
        raise ValueError(f"{name} expects a high-precision float tensor (bf16/fp16/fp32), got {x_hp.dtype}")


def quantize_tensorwise_ref(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None = None, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor. Returns (x_fp8 same shape as x_hp, scale 0-d fp32). amax: a given amax
    (reduced elsewhere, e.g. across ranks) instead of max |x|."""
    check_fp8_dtype(fp8_dtype)
    if amax is None:
        amax = abs_amax(x_hp)
    scale = amax_to_scale(amax.reshape(()), fp8_dtype, pow2)
    return saturated_cast(x_hp, scale, fp8_dtype), scale


def quantize_rowwise_ref(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True, dim: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per slice reduced along `dim` (keepdim). 2D x [M, N]: dim=-1 -> (x_fp8 [M, N], scale_M1 fp32 [M, 1]);
    dim=0 -> scale_1N; any other rank likewise (e.g. [E, K, N] expert weights scaled along K with dim=-2)."""
    check_fp8_dtype(fp8_dtype)
    if not x_hp.is_floating_point() or x_hp.dtype in FP8_DTYPES:
        raise ValueError(f"quantize_rowwise expects a high-precision float tensor (bf16/fp16/fp32), got {x_hp.dtype}")
    scale = amax_to_scale(abs_amax(x_hp, dim=dim, keepdim=True), fp8_dtype, pow2)
    return saturated_cast(x_hp, scale, fp8_dtype), scale


def quantize_rowwise_and_colwise_ref(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-scaled and column-scaled copies of x for the forward and backward GEMMs.

    Returns (x_fp8_MN, scale_M1, x_fp8_t_NM, scale_1N):
    - x_fp8_MN: row-major [M, N], x_fp8_MN[m, n] = sat(x[m, n] * scale_M1[m]).
    - x_fp8_t_NM: [N, M] contiguous (row-major), x_fp8_t_NM[n, m] = sat(x[m, n] * scale_1N[n]). Its `.t()` is the
      colwise-scaled x as an [M, N] column-major tensor. For grad_w = grad_y^T @ x with torch._scaled_mm:
      a = grad_y's x_fp8_t_NM (row-major [N, M]), b = x's x_fp8_t.t() (column-major [M, K]),
      scale_a = grad_y's scale_1N.reciprocal().reshape(N, 1) (a .t() view fails _scaled_mm's stride check),
      scale_b = x's scale_1K.reciprocal() ([1, K]).
    """
    check_fp8_dtype(fp8_dtype)
    check_2d_high_precision(x_hp_MN, "quantize_rowwise_and_colwise")
    scale_M1 = amax_to_scale(abs_amax(x_hp_MN, dim=1, keepdim=True), fp8_dtype, pow2)
    scale_1N = amax_to_scale(abs_amax(x_hp_MN, dim=0, keepdim=True), fp8_dtype, pow2)
    x_fp8_MN = saturated_cast(x_hp_MN, scale_M1, fp8_dtype)
    x_fp8_t_NM = saturated_cast(x_hp_MN, scale_1N, fp8_dtype).t().contiguous()
    return x_fp8_MN, scale_M1, x_fp8_t_NM, scale_1N


def transpose_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] or [B, M, N] with its last two dims swapped, contiguous; any dtype (fp8 data moves bit for bit)."""
    return x.transpose(-2, -1).contiguous()


def group_ids(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index of each row for int32 cumulative end offsets (torch._grouped_mm semantics).

    Row m belongs to group e when offs[e-1] <= m < offs[e]; rows at or past offs[-1] get index E (no group).
    """
    rows_M = torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows_M, right=True)


def cross_entropy_fwd_ref(
    logits_MV: torch.Tensor, targets_M: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row token cross-entropy in fp32 and what its fp8 backward needs, without forming the gradient.

    Returns fp32 [M] tensors (lse_M, loss_M, gamax_M): lse = logsumexp of the row; loss = lse - logit[target];
    gamax = max over the row of |softmax - onehot(target)| = max(max over non-targets of p, 1 - p_target), the
    row's largest gradient element before the loss's scalar factor. Rows whose target is ignore_index: loss and
    gamax 0 (lse still computed).
    """
    x_MV = logits_MV.float()
    lse_M = torch.logsumexp(x_MV, dim=1)
    valid_M = targets_M != ignore_index
    t_M1 = torch.where(valid_M, targets_M, 0).long()[:, None]
    x_t_M = x_MV.gather(1, t_M1).squeeze(1)
    other_max_M = x_MV.scatter(1, t_M1, float("-inf")).amax(dim=1)
    gamax_M = torch.maximum(torch.exp(other_max_M - lse_M), 1.0 - torch.exp(x_t_M - lse_M))
    zero = x_MV.new_zeros(())
    return lse_M, torch.where(valid_M, lse_M - x_t_M, zero), torch.where(valid_M, gamax_M, zero)


def cross_entropy_grad_cast_ref(
    logits_MV: torch.Tensor, targets_M: torch.Tensor, lse_M: torch.Tensor, gamax: torch.Tensor, coef: torch.Tensor,
    fp8_dtype: torch.dtype, ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits' gradient coef * (softmax - onehot(target)), tensorwise-quantized in both layouts.

    gamax: 0-d, the max of cross_entropy_fwd_ref's gamax_M (so coef * gamax is the gradient's exact amax); coef:
    0-d, d(loss)/d(sum of row losses), e.g. grad_loss / number of counted rows. Returns (g_fp8_MV, g_fp8_t_VM
    contiguous [V, M], scale 0-d fp32) with g_fp8 = saturate(g * scale), scale = fp8_max / max(|coef| * gamax, EPS).
    Ignored rows are zeros.
    """
    check_fp8_dtype(fp8_dtype)
    coef = coef.float().reshape(())
    scale = amax_to_scale(gamax.float().reshape(()) * coef.abs(), fp8_dtype)
    p_MV = torch.exp(logits_MV.float() - lse_M[:, None])
    valid_M = targets_M != ignore_index
    onehot_MV = torch.zeros_like(p_MV).scatter_(1, torch.where(valid_M, targets_M, 0).long()[:, None], 1.0)
    g_MV = torch.where(valid_M[:, None], p_MV - onehot_MV, 0.0)
    row_coef_M1 = torch.where(valid_M, coef * scale, 0.0)[:, None]
    g_fp8_MV = saturated_cast(g_MV, row_coef_M1, fp8_dtype)
    return g_fp8_MV, g_fp8_MV.t().contiguous(), scale


def quantize_rowwise_group_scaled_ref(
    x_hp_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise quantization of y = x * mul_GN[gid_M[m], :] (fp32 product): (y_fp8_MN, scale_M1).

    For MoE grad-input GEMMs that reuse the forward's quantized weights: the weights' row scales (per expert and
    output column, powers of two, so the product is exact) move onto the gradient's columns, group by group.
    """
    check_fp8_dtype(fp8_dtype)
    check_2d_high_precision(x_hp_MN, "quantize_rowwise_group_scaled")
    y_MN = x_hp_MN.float() * mul_GN.float()[gid_M.long()]
    return quantize_rowwise_ref(y_MN, fp8_dtype, pow2)


def cast_rows_transposed_batched_ref(x_hp_BRC: torch.Tensor, scale_BR: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """out_t [B, C, R] contiguous, out_t[b, c, r] = sat(x[b, r, c] * scale_BR[b, r]): the cast of an [E, N, K]-stored
    expert weight by its forward row scales, laid out [E, K, N] for the grad-input GEMM."""
    check_fp8_dtype(fp8_dtype)
    return saturated_cast(x_hp_BRC, scale_BR.float()[:, :, None], fp8_dtype).transpose(-2, -1).contiguous()
