"""FP8 quantize kernels: the casts around the FP8 GEMMs, Triton on GPUs and pure PyTorch elsewhere.

Public functions (torch tensors in and out, any device):
- quantize_tensorwise(x_hp, fp8_dtype, amax=None) -> (x_fp8, scale [] fp32)
- quantize_rowwise(x_hp_MN, fp8_dtype, pow2=True) -> (x_fp8_MN, scale_M1)
- quantize_rowwise_and_colwise(x_hp_MN, fp8_dtype, pow2=True) -> (x_fp8_MN, scale_M1, x_fp8_t_NM, scale_1N)
- transpose(x_MN) -> x^T contiguous [N, M] (fp8 operands for torch._scaled_mm)
- quantize_rowwise_group_scaled(x_hp_MN, mul_GN, gid_M, fp8_dtype, pow2=True) -> (y_fp8_MN, scale_M1) of
  y = x * mul[gid[m], :]; cast_rows_transposed_batched(x_hp_BRC, scale_BR, fp8_dtype) -> x_fp8_t_BCR by given row
  scales: the MoE grad-input GEMM on the forward's quantized expert weights (fp8/grouped.py)
- cross_entropy_fwd(logits_MV, targets_M, ignore_index) -> (lse_M, loss_M, gamax_M) and
  cross_entropy_grad_cast(logits_MV, targets_M, lse_M, gamax, coef, fp8_dtype, ignore_index) -> (g_fp8_MV,
  g_fp8_t_VM, scale): the fused FP8 output head's loss (cross_entropy.py; eager only, no torch.library op)

Scale convention (all functions): x_fp8 = saturate(x_hp * scale), x_hp ~= x_fp8 / scale, so torch._scaled_mm's
scale arguments are `scale.reciprocal()` (exact for pow2 scales). Layouts are documented on each function and in
fp8/reference.py, which holds the pure-PyTorch definition of every result. Kernels: quantize.py (the casts),
transposed.py (fp8 data written transposed), cross_entropy.py (the fused head's loss); triton_fp8.py (what they share).

Backend choice, per call: use_triton=None (default) runs the Triton kernels on CUDA/ROCm tensors (under
torch.compile through the torch.library Triton ops "elastic_fp8::*", whose kernels Inductor launches itself;
in eager mode the launchers directly, saving the dispatcher's host time) and the reference on any other device;
use_triton=True forces the kernels (on CPU only with TRITON_INTERPRET=1 set before this package is imported);
use_triton=False forces the reference. `set_default_use_triton` changes the default for the process.

Shape legend: M rows (tokens), N or K columns (features), E expert groups; suffix _t = stored transposed.
"""

from __future__ import annotations

import torch

from fp8.reference import (
    FP8_DTYPES,
    cast_rows_transposed_batched_ref,
    check_fp8_dtype,
    cross_entropy_fwd_ref,
    cross_entropy_grad_cast_ref,
    quantize_rowwise_and_colwise_ref,
    quantize_rowwise_group_scaled_ref,
    quantize_rowwise_ref,
    quantize_tensorwise_ref,
)

from . import cross_entropy as _ce
from . import ops
from . import quantize as _q
from . import transposed as _t
from .triton_fp8 import HAS_TRITON, triton_usable

__all__ = [
    "HAS_TRITON",
    "cast_rows_transposed_batched",
    "cross_entropy_fwd",
    "cross_entropy_grad_cast",
    "quantize_rowwise",
    "quantize_rowwise_and_colwise",
    "quantize_rowwise_group_scaled",
    "quantize_tensorwise",
    "set_default_use_triton",
    "transpose",
    "will_use_triton",
]

_DEFAULT_USE_TRITON: bool | None = None


def set_default_use_triton(flag: bool | None) -> None:
    """Process-wide default for use_triton=None calls: None = auto (Triton on CUDA/ROCm), True, or False."""
    global _DEFAULT_USE_TRITON
    _DEFAULT_USE_TRITON = flag


def will_use_triton(x: torch.Tensor, use_triton: bool | None = None) -> bool:
    """Whether a call on x with this use_triton runs the Triton kernels (raises if forced where it cannot)."""
    flag = _DEFAULT_USE_TRITON if use_triton is None else use_triton
    if flag is None:
        return HAS_TRITON and x.is_cuda
    if flag:
        if not triton_usable(x):
            raise ValueError(
                f"use_triton=True but Triton cannot run on device {x.device} here: it needs a CUDA/ROCm tensor with "
                "triton installed, or TRITON_INTERPRET=1 set before fp8.kernels is imported (CPU interpreter)"
            )
        return True
    return False


def _run_triton(op, launcher, *args):
    # Eager: the launcher directly (the custom-op dispatcher adds tens of microseconds of host time per call,
    # comparable to the kernels themselves at 8192x4096). Under torch.compile: the Triton op, whose body
    # Inductor traces down to the kernels (see ops.py).
    if torch.compiler.is_compiling():
        return op(*args)
    return launcher(*args)


def _check_2d(x_hp: torch.Tensor, name: str) -> None:
    if x_hp.dim() != 2:
        raise ValueError(f"{name} expects a 2D tensor [M, N], got shape {tuple(x_hp.shape)}; reshape first")
    if not x_hp.is_floating_point() or x_hp.dtype in FP8_DTYPES:
        raise ValueError(f"{name} expects a high-precision float tensor (bf16/fp16/fp32), got {x_hp.dtype}")


def quantize_tensorwise(
    x_hp: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor: scale = fp8_max / max(amax, EPS), 0-d fp32; x_fp8 has x_hp's shape.

    amax=None computes max |x| first (Triton: a reduction pass, then the cast pass computes the scale in-kernel);
    a given amax (delayed scaling, or reduced elsewhere, e.g. across ranks) skips the reduction: one pass.
    """
    check_fp8_dtype(fp8_dtype)
    if not x_hp.is_floating_point() or x_hp.dtype in FP8_DTYPES:
        raise ValueError(f"quantize_tensorwise expects a high-precision float tensor, got {x_hp.dtype}")
    if amax is not None and amax.numel() != 1:
        raise ValueError(f"amax must hold one value, got shape {tuple(amax.shape)}")
    if will_use_triton(x_hp, use_triton):
        return _run_triton(ops.quantize_tensorwise_op, _q.quantize_tensorwise_triton, x_hp, fp8_dtype, amax)
    return quantize_tensorwise_ref(x_hp, fp8_dtype, amax)


def quantize_rowwise(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row, in one read of x. Returns (x_fp8_MN row-major [M, N], scale_M1 fp32 [M, 1])."""
    check_fp8_dtype(fp8_dtype)
    _check_2d(x_hp_MN, "quantize_rowwise")
    if will_use_triton(x_hp_MN, use_triton):
        return _run_triton(ops.quantize_rowwise_op, _q.quantize_rowwise_triton, x_hp_MN, fp8_dtype, pow2)
    return quantize_rowwise_ref(x_hp_MN, fp8_dtype, pow2)


def quantize_rowwise_and_colwise(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-scaled and column-scaled fp8 copies of x for the three GEMMs of a linear layer.

    Returns (x_fp8_MN, scale_M1, x_fp8_t_NM, scale_1N):
    - x_fp8_MN [M, N] row-major, scaled per row (scale_M1 [M, 1]): the left operand of out = x @ w^T, or of
      grad_x = grad_y @ w.
    - x_fp8_t_NM [N, M] contiguous, i.e. the column-scaled x (scale_1N [1, N]) stored transposed; x_fp8_t_NM.t()
      is that [M, N] tensor in column-major layout. For grad_w[N, K] = grad_y^T @ x in torch._scaled_mm:
      a = grad_y's x_fp8_t_NM, scale_a = grad_y's scale_1N.reciprocal().reshape(N, 1) (not .t(): _scaled_mm
      checks stride(1) == 1),
      b = x's x_fp8_t_KM.t() (column-major [M, K]), scale_b = x's scale_1K.reciprocal() ([1, K]).
    Triton: one pass reads x for both amaxes, one pass reads it again and writes both outputs (column scales
    need every row, so this is the least traffic for whole-column scales).
    """
    check_fp8_dtype(fp8_dtype)
    _check_2d(x_hp_MN, "quantize_rowwise_and_colwise")
    if will_use_triton(x_hp_MN, use_triton):
        return _run_triton(ops.quantize_rowwise_and_colwise_op, _q.quantize_rowwise_and_colwise_triton, x_hp_MN,
                           fp8_dtype, pow2)
    return quantize_rowwise_and_colwise_ref(x_hp_MN, fp8_dtype, pow2)


def transpose(x_MN: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """x^T as a contiguous [N, M] tensor (any 2D input, any dtype; the reference is x.t().contiguous())."""
    if x_MN.dim() != 2:
        raise ValueError(f"transpose expects a 2D tensor, got shape {tuple(x_MN.shape)}")
    if will_use_triton(x_MN, use_triton):
        return _run_triton(ops.transpose_op, _t.transpose_triton, x_MN)
    return x_MN.t().contiguous()


def _check_ce(logits_MV: torch.Tensor, targets_M: torch.Tensor, name: str) -> None:
    if logits_MV.dim() != 2 or not logits_MV.is_floating_point() or logits_MV.dtype in FP8_DTYPES:
        raise ValueError(f"{name} expects [M, V] high-precision logits, got {logits_MV.dtype} of shape "
                         f"{tuple(logits_MV.shape)}; flatten the batch dims first")
    if targets_M.shape != (logits_MV.shape[0],) or targets_M.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} expects int64/int32 targets of shape ({logits_MV.shape[0]},), got "
                         f"{targets_M.dtype} of shape {tuple(targets_M.shape)}")


def cross_entropy_fwd(
    logits_MV: torch.Tensor, targets_M: torch.Tensor, ignore_index: int = -100, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy and the row maxima of its gradient: (lse_M, loss_M, gamax_M) fp32 (definition:
    fp8.reference.cross_entropy_fwd_ref). Targets must lie in [0, V) or equal ignore_index: the kernel does not check
    (that would sync the host); the reference raises on an out-of-range index."""
    _check_ce(logits_MV, targets_M, "cross_entropy_fwd")
    if will_use_triton(logits_MV, use_triton):
        return _ce.cross_entropy_fwd_triton(logits_MV.contiguous(), targets_M, ignore_index)
    return cross_entropy_fwd_ref(logits_MV, targets_M, ignore_index)


def cross_entropy_grad_cast(
    logits_MV: torch.Tensor, targets_M: torch.Tensor, lse_M: torch.Tensor, gamax: torch.Tensor, coef: torch.Tensor,
    fp8_dtype: torch.dtype, ignore_index: int = -100, *, use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """coef * (softmax - onehot) quantized tensorwise in both layouts, from the forward's lse and gradient amax:
    (g_fp8_MV, g_fp8_t_VM, scale) (definition: fp8.reference.cross_entropy_grad_cast_ref). One read of the logits."""
    check_fp8_dtype(fp8_dtype)
    _check_ce(logits_MV, targets_M, "cross_entropy_grad_cast")
    if will_use_triton(logits_MV, use_triton):
        return _ce.cross_entropy_grad_cast_triton(logits_MV.contiguous(), targets_M, lse_M, gamax, coef, fp8_dtype,
                                                  ignore_index)
    return cross_entropy_grad_cast_ref(logits_MV, targets_M, lse_M, gamax, coef, fp8_dtype, ignore_index)


def quantize_rowwise_group_scaled(
    x_hp_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool = True, *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise quantization of y = x * mul_GN[gid_M[m], :] in one read of x: (y_fp8_MN, scale_M1) (definition:
    fp8.reference.quantize_rowwise_group_scaled_ref). gid_M: int32 group of each row, in [0, G)."""
    check_fp8_dtype(fp8_dtype)
    _check_2d(x_hp_MN, "quantize_rowwise_group_scaled")
    if mul_GN.dim() != 2 or mul_GN.shape[1] != x_hp_MN.shape[1] or gid_M.shape != (x_hp_MN.shape[0],):
        raise ValueError(f"quantize_rowwise_group_scaled: mul must be [G, {x_hp_MN.shape[1]}] and gid [{x_hp_MN.shape[0]}]"
                         f", got {tuple(mul_GN.shape)} and {tuple(gid_M.shape)}")
    if will_use_triton(x_hp_MN, use_triton):
        return _run_triton(ops.quantize_rowwise_group_scaled_op, _q.quantize_rowwise_group_scaled_triton, x_hp_MN,
                           mul_GN, gid_M, fp8_dtype, pow2)
    return quantize_rowwise_group_scaled_ref(x_hp_MN, mul_GN, gid_M, fp8_dtype, pow2)


def cast_rows_transposed_batched(
    x_hp_BRC: torch.Tensor, scale_BR: torch.Tensor, fp8_dtype: torch.dtype, *, use_triton: bool | None = None
) -> torch.Tensor:
    """x_fp8_t_BCR [B, C, R] contiguous = sat(x[b, r, c] * scale_BR[b, r]) transposed per batch, by given scales (no
    amax pass); x any strides (definition: fp8.reference.cast_rows_transposed_batched_ref)."""
    check_fp8_dtype(fp8_dtype)
    if x_hp_BRC.dim() != 3 or scale_BR.shape != x_hp_BRC.shape[:2]:
        raise ValueError(f"cast_rows_transposed_batched: x must be [B, R, C] and scale [B, R], got "
                         f"{tuple(x_hp_BRC.shape)} and {tuple(scale_BR.shape)}")
    if will_use_triton(x_hp_BRC, use_triton):
        return _run_triton(ops.cast_rows_transposed_batched_op, _t.cast_rows_transposed_batched_triton, x_hp_BRC,
                           scale_BR, fp8_dtype)
    return cast_rows_transposed_batched_ref(x_hp_BRC, scale_BR, fp8_dtype)
