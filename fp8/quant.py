"""Dispatch layer for quantization: fused Triton kernels (fp8/kernels) on GPUs, the PyTorch reference otherwise.

Every function follows the conventions of fp8/reference.py (x_fp8 = sat(x * scale), fp32 scales), the one
definition of the numerics. The kernels package is imported lazily on first GPU use; if it is missing, fails to
import, or lacks a function, the reference runs instead - compiled with torch.compile on GPUs, where eager PyTorch
would make one memory pass per elementwise op. The kernels match the reference bit for bit.

Legend: M rows, N columns, K contraction dim, E experts/groups.
"""

from __future__ import annotations

import functools
import warnings

import torch

from fp8 import reference
from fp8.health import health_stats_ref

# The kernels package once looked up, as a plain global rather than functools.cache: torch.compile traces
# through _kernel_fn, and dynamo ignores an lru_cache wrapper (re-tracing the import each time, with a warning);
# a global read is a constant to it.
_KERNELS_LOOKED_UP = False
_KERNELS_MODULE = None


def _kernels():
    global _KERNELS_LOOKED_UP, _KERNELS_MODULE
    if not _KERNELS_LOOKED_UP and torch.compiler.is_compiling():
        # Look up without storing while dynamo traces: inside an autograd.Function (a higher-order op to dynamo)
        # a store to module state is a "non-nullified side effect", and the whole Function then graph-breaks and
        # runs eagerly. That happened to every tensorwise Float8Linear, whose first lookup is in its backward:
        # the dense Llama3-8B step spent ~120 ms of host per step in the eager backwards and swung between 190
        # and 270 ms on the H200. Float8Linear.from_float and Fp8GroupedMM (so convert_to_fp8)
        # look the kernels up eagerly (a graph traced before the lookup guards on it and recompiles once after it).
        return _import_kernels()
    if not _KERNELS_LOOKED_UP:
        _KERNELS_MODULE = _import_kernels()
        _KERNELS_LOOKED_UP = True
    return _KERNELS_MODULE


def _import_kernels():
    try:
        from fp8 import kernels
    except Exception:  # noqa: BLE001  # any import failure (no Triton, no GPU support) means "use the reference"
        return None
    return kernels


_FAILED: set[str] = set()
# The casts that stay our kernels inside torch.compile'd code (Inductor launches them itself); the tensorwise cast is
# traced instead, so Inductor fuses it into its producers. Measured on the H200: the step of 8 Llama3-8B-width layers
# ran 190.4 ms with the row and row+column casts as kernels vs 198.8 ms with Inductor fusing the references (same
# run); the tensorwise recipe's fp8 transposed copies for backward as our transpose kernel 186.7 ms vs 197.2 ms written
# by Inductor (same run); every cast a kernel (the tensorwise one too) 202.65 ms against 185.6 ms of GPU kernel time,
# ~500 more launches a step leaving the GPU idle.
_KERNELS_UNDER_COMPILE = (
    "quantize_rowwise", "quantize_rowwise_and_colwise", "transpose", "quantize_rowwise_group_scaled",
    "cast_rows_transposed_batched",
)


def _kernel_fn(x: torch.Tensor, name: str):
    if not x.is_cuda:
        return None
    if torch.compiler.is_compiling() and name not in _KERNELS_UNDER_COMPILE:
        return None
    mod = _kernels()
    if mod is None or name in _FAILED:
        return None
    return getattr(mod, name, None)


def _call(name: str, kernel, ref, *args, **kwargs):
    """Run the kernel; on an exception (an unsupported shape or dtype) warn once and use the reference."""
    try:
        return kernel(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  # the kernels are an optimization: never let them stop training
        if torch.compiler.is_compiling():
            # No record or warning while dynamo traces: inside an autograd.Function both are side effects it refuses,
            # and the Function would fall out of the graph (see _kernels). The eager path records the failure.
            return ref
        _FAILED.add(name)
        warnings.warn(f"fp8.kernels.{name} failed ({type(e).__name__}: {e}); using the PyTorch reference", stacklevel=3)
        return ref


def look_up_kernels_eagerly() -> None:
    """Resolve the kernels package now, outside any torch.compile trace (see _kernels); cheap after the first call.
    Only where CUDA exists: CPU-only processes never need Triton imported."""
    if torch.cuda.is_available() and not torch.compiler.is_compiling():
        _kernels()


def kernels_active(device: torch.device | str) -> bool:
    """Whether the Triton kernels serve quantization on `device` (for benchmark reports)."""
    return torch.device(device).type == "cuda" and _kernels() is not None


@functools.cache
def _compiled(fn):
    # dynamic=True: one compiled kernel per function for every shape (benchmarks sweep many shapes).
    return torch.compile(fn, dynamic=True)


def _ref(x: torch.Tensor, fn):
    if x.is_cuda and not torch.compiler.is_compiling():
        return _compiled(fn)
    return fn


def quantize_tensorwise(x_hp: torch.Tensor, dtype: torch.dtype, pow2: bool = False):
    """-> (x_fp8, scale 0-d float32)."""
    k = _kernel_fn(x_hp, "quantize_tensorwise")
    if k is not None and not pow2:
        out = _call("quantize_tensorwise", k, None, x_hp, dtype)
        if out is not None:
            return out
    return _ref(x_hp, reference.quantize_tensorwise_ref)(x_hp, dtype, None, pow2)


def quantize_rowwise(x_hp: torch.Tensor, dtype: torch.dtype, dim: int = -1, pow2: bool = True):
    """One scale per slice reduced along `dim` (keepdim). 2D x: dim=-1 -> (M, 1), dim=0 -> (1, K)."""
    k = _kernel_fn(x_hp, "quantize_rowwise")
    if k is not None and dim in (-1, x_hp.dim() - 1):
        # Rows along the last dim: any leading dims flatten into M (e.g. [E, K, N] expert weights). A strided x
        # (the [E, K, N] view of [E, N, K]-stored experts) is copied first: copy + kernel is one extra pass,
        # where the compiled reference on the strided view took 3.7 ms for DeepSeek-MoE's w13 on the H200.
        x_hp = x_hp.contiguous()
        out = _call("quantize_rowwise", k, None, x_hp.reshape(-1, x_hp.shape[-1]), dtype, pow2=pow2)
        if out is not None:
            x_fp8, scale = out
            return x_fp8.view(x_hp.shape), scale.view(*x_hp.shape[:-1], 1)
    return _ref(x_hp, reference.quantize_rowwise_ref)(x_hp, dtype, pow2, dim)


def transposed_copy(x_MN: torch.Tensor) -> torch.Tensor:
    """x^T as a contiguous [N, M] tensor: the Triton transpose where the kernels run, else x.t().contiguous()."""
    k = _kernel_fn(x_MN, "transpose")
    if k is not None:
        out = _call("transpose", k, None, x_MN)
        if out is not None:
            return out
    return x_MN.t().contiguous()


def quantize_rowwise_group_scaled(x_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, dtype: torch.dtype,
                                  pow2: bool = True):
    """Rowwise quantization of x * mul_GN[gid_M[m], :] -> (fp8 [M, N], scale_M1): one read of x with the kernels."""
    k = _kernel_fn(x_MN, "quantize_rowwise_group_scaled")
    if k is not None:
        out = _call("quantize_rowwise_group_scaled", k, None, x_MN.contiguous(), mul_GN, gid_M, dtype, pow2=pow2)
        if out is not None:
            return out
    return _ref(x_MN, reference.quantize_rowwise_group_scaled_ref)(x_MN, mul_GN, gid_M, dtype, pow2)


def cast_rows_transposed_batched(x_BRC: torch.Tensor, scale_BR: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, R, C] (any strides) cast by given per-(b, r) scales, written [B, C, R] contiguous."""
    k = _kernel_fn(x_BRC, "cast_rows_transposed_batched")
    if k is not None:
        out = _call("cast_rows_transposed_batched", k, None, x_BRC, scale_BR, dtype)
        if out is not None:
            return out
    return _ref(x_BRC, reference.cast_rows_transposed_batched_ref)(x_BRC, scale_BR, dtype)


def quantize_colwise_3d(w_EKN: torch.Tensor, dtype: torch.dtype, pow2: bool = True):
    """Expert weights scaled per (expert, column n) along K -> (w_fp8 [E, K, N] column-major, scale_E1N).

    With the kernels: the row kernel on the [E*N, K] rows of w's transpose, whose storage is the column-major
    [E, K, N] layout (quantize_rowwise copies it first unless w is already stored [E, N, K]). Otherwise the
    compiled reference plus an fp8 transposed copy.
    """
    e, _, n = w_EKN.shape
    if _kernel_fn(w_EKN, "quantize_rowwise") is not None:
        w_fp8_ENK, scale_EN1 = quantize_rowwise(w_EKN.transpose(-2, -1), dtype, -1, pow2)
        return w_fp8_ENK.transpose(-2, -1), scale_EN1.reshape(e, 1, n)
    w_fp8, scale_E1N = _ref(w_EKN, reference.quantize_rowwise_ref)(w_EKN, dtype, pow2, -2)
    return w_fp8.transpose(-2, -1).contiguous().transpose(-2, -1), scale_E1N


def quantize_rowwise_and_colwise(x_MN: torch.Tensor, dtype: torch.dtype, pow2: bool = True):
    """-> (x_fp8_MN, scale_M1, x_fp8_t_NM, scale_1N): both GEMM layouts from one read of x."""
    k = _kernel_fn(x_MN, "quantize_rowwise_and_colwise")
    if k is not None:
        out = _call("quantize_rowwise_and_colwise", k, None, x_MN, dtype, pow2=pow2)
        if out is not None:
            return out
    return _ref(x_MN, reference.quantize_rowwise_and_colwise_ref)(x_MN, dtype, pow2)


def health_stats(x_hp_MK: torch.Tensor, x_fp8_MK: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """float32 [saturated_frac, underflow_frac, amax] of one cast, on device (fp8.health.health_stats_ref).

    Always the torch reference: under torch.compile Inductor fuses its ~15 ops; in eager op bodies a one-launch Triton
    kernel saved no host time on the H200 hosts, where a Triton launch from Python cost 270-530 us and the reference's
    ~15 torch ops 320-400 us (two machines).
    """
    return health_stats_ref(x_hp_MK, x_fp8_MK, scale, dtype)
