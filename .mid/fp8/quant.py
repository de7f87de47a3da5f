"""The one dispatch of every FP8 cast: per cast, the Triton kernel, its compiled op or the reference.

Each cast is declared once, in `CASTS`: its name ties together the Triton launcher `fp8.kernels.<name>_triton` (what
eager code calls), the torch.library Triton op `elastic_fp8::<name>` (fp8/kernels/ops.py: what torch.compile'd code
calls, so that Inductor launches the kernel itself) and the reference in fp8/reference.py (the one definition of the
numerics, with the launcher's signature; the kernels match it bit for bit). `_kernel_for` is the one fallback policy
deciding which of them runs; `_attempt` is what happens when a kernel fails.

Policy (use_triton=None, what the FP8 modules use):
- the kernel runs on CUDA/ROCm tensors only, where the kernels package imports with Triton (looked up lazily, on the
  first GPU cast: nothing is probed at import, and a CPU-only process never imports Triton);
- under torch.compile only the casts marked `kernel_when_compiled` stay our kernels; the others are traced as the
  reference so that Inductor fuses them into their producers (BENCHMARKS.md, "Tried, did not pay");
- a kernel that raises (an unsupported shape or dtype) warns once and the reference serves that cast from then on;
- the reference runs torch.compile'd on GPUs in eager code, where eager PyTorch would make one memory pass per op.
use_triton=True forces the kernel (errors propagate; on CPU only under TRITON_INTERPRET=1: tests and benchmarks),
use_triton=False forces the reference.

Legend: M rows, N columns, K contraction dim, E experts/groups, B batches, R rows and C columns of a batch, V vocabulary.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8 import reference
from fp8.health import health_stats_ref
from fp8.reference import FP8_DTYPES, check_2d_high_precision, check_fp8_dtype


@dataclass(frozen=True)
class Cast:
    """A cast's name ties its three implementations together: the launcher fp8.kernels.<name>_triton, the op
    elastic_fp8::<name> (fp8.kernels.ops.<name>_op, where it has one) and fp8.reference.<name>_ref, which takes the
    launcher's arguments."""

    name: str
    # Under torch.compile: True keeps our kernel (through its op), False traces the reference for Inductor to fuse.
    kernel_when_compiled: bool

    @property
    def reference(self) -> Callable:
        return getattr(reference, f"{self.name}_ref")


CASTS: dict[str, Cast] = {
    c.name: c
    for c in (
        Cast("quantize_tensorwise", kernel_when_compiled=False),
        Cast("quantize_rowwise", kernel_when_compiled=True),
        Cast("quantize_rowwise_and_colwise", kernel_when_compiled=True),
        Cast("transpose", kernel_when_compiled=True),
        Cast("quantize_rowwise_group_scaled", kernel_when_compiled=True),
        Cast("cast_rows_transposed_batched", kernel_when_compiled=True),
        # The fused FP8 head's loss: eager only (fp8.head runs outside torch.compile), so no op.
        Cast("cross_entropy_fwd", kernel_when_compiled=False),
        Cast("cross_entropy_grad_cast", kernel_when_compiled=False),
    )
}
_TENSORWISE, _ROWWISE, _ROW_COL, _TRANSPOSE, _GROUP_SCALED, _ROWS_T_BATCHED, _CE_FWD, _CE_GRAD = CASTS.values()

# ------------------------------------------------------------------------------------------------ the one policy

# The kernels package once looked up, as a plain global rather than functools.cache: torch.compile traces
# through _kernel_for, and dynamo ignores an lru_cache wrapper (re-tracing the import each time, with a warning);
# a global read is a constant to it.
_KERNELS_LOOKED_UP = False
_KERNELS_MODULE = None


def _kernels():
    """The fp8.kernels package where Triton runs here, else None (looked up once, outside compile traces)."""
    global _KERNELS_LOOKED_UP, _KERNELS_MODULE
    if not _KERNELS_LOOKED_UP and torch.compiler.is_compiling():
        # Look up without storing while dynamo traces: inside an autograd.Function (a higher-order op to dynamo)
        # a store to module state is a "non-nullified side effect", and the whole Function then graph-breaks and
        # runs eagerly - what happened to every tensorwise Float8Linear, whose first lookup is in its backward,
        # costing host time every step. Float8Linear.from_float and Fp8GroupedMM (so convert_to_fp8)
        # look the kernels up eagerly (a graph traced before the lookup guards on it and recompiles once after it).
        return _import_kernels()
    if not _KERNELS_LOOKED_UP:
        _KERNELS_MODULE = _import_kernels()
        _KERNELS_LOOKED_UP = True
    return _KERNELS_MODULE


def _import_kernels():
    try:
        from fp8 import kernels
    except Exception:  # noqa: BLE001  # any import failure (a broken Triton install) means "use the reference"
        return None
    return kernels if kernels.HAS_TRITON else None


def look_up_kernels_eagerly() -> None:
    """Resolve the kernels package now, outside any torch.compile trace (see _kernels); cheap after the first call.
    Only where CUDA exists: CPU-only processes never need Triton imported."""
    if torch.cuda.is_available() and not torch.compiler.is_compiling():
        _kernels()


_FAILED: set[str] = set()  # casts whose kernel raised once in this process: the reference serves them


def _kernel_for(cast: Cast, x: torch.Tensor, use_triton: bool | None) -> Callable | None:
    """The kernel (eager: the launcher; compiled: its op) that runs `cast` on x, or None for the reference."""
    if use_triton is None:
        if not x.is_cuda:
            return None
        compiling = torch.compiler.is_compiling()
        if compiling and not cast.kernel_when_compiled:
            return None
        kernels = _kernels()
        if kernels is None or cast.name in _FAILED:
            return None
    elif use_triton:
        kernels = _kernels()
        if kernels is None or not kernels.triton_usable(x):
            raise ValueError(
                f"use_triton=True but Triton cannot run on device {x.device} here: it needs a CUDA/ROCm tensor with "
                "triton installed, or TRITON_INTERPRET=1 set before fp8.kernels is imported (CPU interpreter)"
            )
        compiling = torch.compiler.is_compiling()
    else:
        return None
    # Eager: the launcher directly (the custom-op dispatcher adds tens of microseconds of host time per call,
    # comparable to the kernels themselves). Compiled: the op, whose body Inductor traces down to the kernels.
    op = getattr(kernels.ops, f"{cast.name}_op", None) if compiling else None
    return op if op is not None else getattr(kernels, f"{cast.name}_triton")


def _attempt(cast: Cast, kernel: Callable, use_triton: bool | None, *args):
    """Run a chosen kernel. Forced (use_triton=True): its errors propagate. Otherwise an error (an unsupported shape or
    dtype) warns once, retires the kernel for this process and returns None: the caller runs the reference."""
    if use_triton:
        return kernel(*args)
    try:
        return kernel(*args)
    except Exception as e:  # noqa: BLE001  # the kernels are an optimization: never let them stop training
        if not torch.compiler.is_compiling():
            # No record or warning while dynamo traces: inside an autograd.Function both are side effects it refuses,
            # and the Function would fall out of the graph (see _kernels). The eager path records the failure.
            _FAILED.add(cast.name)
            warnings.warn(f"fp8.kernels.{cast.name} failed ({type(e).__name__}: {e}); using the PyTorch reference",
                          stacklevel=3)
        return None


@functools.cache
def _compiled(fn):
    # dynamic=True: one compiled kernel per function for every shape (benchmarks sweep many shapes).
    return torch.compile(fn, dynamic=True)


def _reference(cast: Cast, x: torch.Tensor) -> Callable:
    if x.is_cuda and not torch.compiler.is_compiling():
        return _compiled(cast.reference)
    return cast.reference


def _dispatch(cast: Cast, x: torch.Tensor, args: tuple, use_triton: bool | None):
    """The kernel where the policy picks it and it succeeds, else the reference, on the same arguments."""
    kernel = _kernel_for(cast, x, use_triton)
    if kernel is not None:
        out = _attempt(cast, kernel, use_triton, *args)
        if out is not None:
            return out
    return _reference(cast, x)(*args)


# ------------------------------------------------------------------------------------------------ the casts


def quantize_tensorwise(x_hp: torch.Tensor, dtype: torch.dtype, pow2: bool = False, amax: torch.Tensor | None = None,
                        *, use_triton: bool | None = None):
    """One scale for the whole tensor -> (x_fp8 of x's shape, scale 0-d fp32); scale = fp8_max / max(amax, EPS).

    amax=None computes max |x| first (the kernel: a reduction pass, then the cast pass computes the scale in-kernel);
    a given amax (reduced elsewhere, e.g. across ranks) skips the reduction. pow2 scales: the reference (no kernel).
    """
    check_fp8_dtype(dtype)
    if not x_hp.is_floating_point() or x_hp.dtype in FP8_DTYPES:
        raise ValueError(f"quantize_tensorwise expects a high-precision float tensor, got {x_hp.dtype}")
    if amax is not None and amax.numel() != 1:
        raise ValueError(f"amax must hold one value, got shape {tuple(amax.shape)}")
    if pow2:
        return _reference(_TENSORWISE, x_hp)(x_hp, dtype, amax, pow2)
    return _dispatch(_TENSORWISE, x_hp, (x_hp, dtype, amax), use_triton)


def quantize_rowwise(x_hp: torch.Tensor, dtype: torch.dtype, dim: int = -1, pow2: bool = True, *,
                     use_triton: bool | None = None):
    """One scale per slice reduced along `dim` (keepdim). 2D x: dim=-1 -> (x_fp8 [M, N], scale_M1), dim=0 -> scale_1N.
    The kernel serves dim=-1 in one read of x."""
    check_fp8_dtype(dtype)
    if dim in (-1, x_hp.dim() - 1):
        kernel = _kernel_for(_ROWWISE, x_hp, use_triton)
        if kernel is not None:
            # Rows along the last dim: any leading dims flatten into M (e.g. [E, K, N] expert weights). A strided x
            # (the [E, K, N] view of [E, N, K]-stored experts) is copied first: copy + kernel is one extra pass,
            # faster than the compiled reference on the strided view.
            x_hp = x_hp.contiguous()
            out = _attempt(_ROWWISE, kernel, use_triton, x_hp.reshape(-1, x_hp.shape[-1]), dtype, pow2)
            if out is not None:
                x_fp8, scale = out
                return x_fp8.view(x_hp.shape), scale.view(*x_hp.shape[:-1], 1)
    return _reference(_ROWWISE, x_hp)(x_hp, dtype, pow2, dim)


def quantize_rowwise_and_colwise(x_MN: torch.Tensor, dtype: torch.dtype, pow2: bool = True, *,
                                 use_triton: bool | None = None):
    """Row-scaled and column-scaled fp8 copies of x for the three GEMMs of a linear layer, from one read of x:
    (x_fp8_MN, scale_M1, x_fp8_t_NM, scale_1N); layouts in fp8.reference.quantize_rowwise_and_colwise_ref."""
    check_fp8_dtype(dtype)
    check_2d_high_precision(x_MN, "quantize_rowwise_and_colwise")
    return _dispatch(_ROW_COL, x_MN, (x_MN, dtype, pow2), use_triton)


def transpose(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """x [M, N] or [B, M, N] (any strides, any dtype) with its last two dims swapped, contiguous: the fp8 operand
    layouts torch._scaled_mm and torch._scaled_grouped_mm want."""
    if x.dim() not in (2, 3):
        raise ValueError(f"transpose expects a 2D or 3D tensor, got shape {tuple(x.shape)}")
    return _dispatch(_TRANSPOSE, x, (x,), use_triton)


def quantize_rowwise_group_scaled(x_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, dtype: torch.dtype,
                                  pow2: bool = True, *, use_triton: bool | None = None):
    """Rowwise quantization of y = x * mul_GN[gid_M[m], :] -> (y_fp8_MN, scale_M1): one read of x with the kernel.
    gid_M: int32 group of each row, in [0, G)."""
    check_fp8_dtype(dtype)
    check_2d_high_precision(x_MN, "quantize_rowwise_group_scaled")
    if mul_GN.dim() != 2 or mul_GN.shape[1] != x_MN.shape[1] or gid_M.shape != (x_MN.shape[0],):
        raise ValueError(f"quantize_rowwise_group_scaled: mul must be [G, {x_MN.shape[1]}] and gid [{x_MN.shape[0]}]"
                         f", got {tuple(mul_GN.shape)} and {tuple(gid_M.shape)}")
    kernel = _kernel_for(_GROUP_SCALED, x_MN, use_triton)
    if kernel is not None:
        out = _attempt(_GROUP_SCALED, kernel, use_triton, x_MN.contiguous(), mul_GN, gid_M, dtype, pow2)
        if out is not None:
            return out
    return _reference(_GROUP_SCALED, x_MN)(x_MN, mul_GN, gid_M, dtype, pow2)


def cast_rows_transposed_batched(x_BRC: torch.Tensor, scale_BR: torch.Tensor, dtype: torch.dtype, *,
                                 use_triton: bool | None = None) -> torch.Tensor:
    """[B, R, C] (any strides) cast by given per-(b, r) scales, written [B, C, R] contiguous (no amax pass)."""
    check_fp8_dtype(dtype)
    if x_BRC.dim() != 3 or scale_BR.shape != x_BRC.shape[:2]:
        raise ValueError(f"cast_rows_transposed_batched: x must be [B, R, C] and scale [B, R], got "
                         f"{tuple(x_BRC.shape)} and {tuple(scale_BR.shape)}")
    return _dispatch(_ROWS_T_BATCHED, x_BRC, (x_BRC, scale_BR, dtype), use_triton)


def quantize_colwise_3d(w_EKN: torch.Tensor, dtype: torch.dtype, pow2: bool = True):
    """Expert weights scaled per (expert, column n) along K -> (w_fp8 [E, K, N] column-major, scale_E1N).

    Where the row kernel serves: it runs on the [E*N, K] rows of w's transpose, whose storage is the column-major
    [E, K, N] layout (quantize_rowwise copies it first unless w is already stored [E, N, K]). Otherwise the
    reference along K plus an fp8 transposed copy.
    """
    e, _, n = w_EKN.shape
    if _kernel_for(_ROWWISE, w_EKN, None) is not None:
        w_fp8_ENK, scale_EN1 = quantize_rowwise(w_EKN.transpose(-2, -1), dtype, -1, pow2)
        return w_fp8_ENK.transpose(-2, -1), scale_EN1.reshape(e, 1, n)
    w_fp8, scale_E1N = _reference(_ROWWISE, w_EKN)(w_EKN, dtype, pow2, -2)
    return w_fp8.transpose(-2, -1).contiguous().transpose(-2, -1), scale_E1N


def _check_ce(logits_MV: torch.Tensor, targets_M: torch.Tensor, name: str) -> None:
    if logits_MV.dim() != 2 or not logits_MV.is_floating_point() or logits_MV.dtype in FP8_DTYPES:
        raise ValueError(f"{name} expects [M, V] high-precision logits, got {logits_MV.dtype} of shape "
                         f"{tuple(logits_MV.shape)}; flatten the batch dims first")
    if targets_M.shape != (logits_MV.shape[0],) or targets_M.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} expects int64/int32 targets of shape ({logits_MV.shape[0]},), got "
                         f"{targets_M.dtype} of shape {tuple(targets_M.shape)}")


def cross_entropy_fwd(logits_MV: torch.Tensor, targets_M: torch.Tensor, ignore_index: int = -100, *,
                      use_triton: bool | None = None):
    """Per-row cross-entropy and the row maxima of its gradient: (lse_M, loss_M, gamax_M) fp32 (definition:
    fp8.reference.cross_entropy_fwd_ref). Targets must lie in [0, V) or equal ignore_index: the kernel does not check
    (that would sync the host); the reference raises on an out-of-range index."""
    _check_ce(logits_MV, targets_M, "cross_entropy_fwd")
    kernel = _kernel_for(_CE_FWD, logits_MV, use_triton)
    if kernel is not None:
        out = _attempt(_CE_FWD, kernel, use_triton, logits_MV.contiguous(), targets_M, ignore_index)
        if out is not None:
            return out
    return _reference(_CE_FWD, logits_MV)(logits_MV, targets_M, ignore_index)


def cross_entropy_grad_cast(logits_MV: torch.Tensor, targets_M: torch.Tensor, lse_M: torch.Tensor,
                            gamax: torch.Tensor, coef: torch.Tensor, dtype: torch.dtype, ignore_index: int = -100, *,
                            use_triton: bool | None = None):
    """coef * (softmax - onehot) quantized tensorwise in both layouts, from the forward's lse and gradient amax:
    (g_fp8_MV, g_fp8_t_VM, scale) (definition: fp8.reference.cross_entropy_grad_cast_ref). One read of the logits."""
    check_fp8_dtype(dtype)
    _check_ce(logits_MV, targets_M, "cross_entropy_grad_cast")
    kernel = _kernel_for(_CE_GRAD, logits_MV, use_triton)
    if kernel is not None:
        out = _attempt(_CE_GRAD, kernel, use_triton, logits_MV.contiguous(), targets_M, lse_M, gamax, coef, dtype,
                       ignore_index)
        if out is not None:
            return out
    return _reference(_CE_GRAD, logits_MV)(logits_MV, targets_M, lse_M, gamax, coef, dtype, ignore_index)


def health_stats(x_hp_MK: torch.Tensor, x_fp8_MK: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """float32 [saturated_frac, underflow_frac, amax] of one cast, on device (fp8.health.health_stats_ref).

    Always the torch reference: under torch.compile Inductor fuses its ~15 ops; in eager op bodies a one-launch Triton
    kernel saved no host time, a Triton launch from Python costing about as much as the reference's torch ops
    (BENCHMARKS.md, "Tried, did not pay").
    """
    return health_stats_ref(x_hp_MK, x_fp8_MK, scale, dtype)
