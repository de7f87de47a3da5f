"""torch.library Triton ops (namespace "elastic_fp8") around the quantize kernels, for torch.compile.

Why `torch.library.triton_op` (and not an opaque custom op): Inductor traces the op's body, sees each Triton
kernel through `wrap_triton`, and launches it from its generated code like its own kernels. An opaque custom op
instead costs a Python dispatch and a Triton JIT launch per call at run time: with the casts as kernels, a
compiled Llama3-8B-width training step of 8 layers spent ~17 ms per step with the GPU idle waiting for those
host launches (BENCHMARKS.md). The ops carry no autograd formula: quantization is called inside the FP8
linear's autograd.Function, where grad mode is off.

On CUDA/ROCm tensors an op runs the Triton kernels; on any other device it runs the pure-PyTorch reference
(also while tracing, so a compiled model still runs on a CPU-only machine; the Triton interpreter is used by
calling the launchers in quantize.py and transposed.py directly). In eager mode fp8.kernels calls the launchers
directly (the dispatcher costs host time); these ops are what torch.compile sees.
"""

from __future__ import annotations

import torch

from fp8 import reference as _ref

from . import quantize as _q
from . import transposed as _t
from .triton_fp8 import HAS_TRITON


def _on_gpu(x: torch.Tensor) -> bool:
    # Decided on the device alone, so the same branch is taken for a real tensor and for its fake twin
    # while Inductor traces the body.
    return HAS_TRITON and x.is_cuda


@torch.library.triton_op("elastic_fp8::quantize_tensorwise", mutates_args=())
def quantize_tensorwise_op(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_gpu(x_hp):
        return _q.quantize_tensorwise_triton(x_hp, fp8_dtype, amax)
    return _ref.quantize_tensorwise_ref(x_hp, fp8_dtype, amax)


@torch.library.triton_op("elastic_fp8::quantize_rowwise", mutates_args=())
def quantize_rowwise_op(x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_gpu(x_hp_MN):
        return _q.quantize_rowwise_triton(x_hp_MN, fp8_dtype, pow2)
    return _ref.quantize_rowwise_ref(x_hp_MN, fp8_dtype, pow2)


@torch.library.triton_op("elastic_fp8::quantize_rowwise_and_colwise", mutates_args=())
def quantize_rowwise_and_colwise_op(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _on_gpu(x_hp_MN):
        return _q.quantize_rowwise_and_colwise_triton(x_hp_MN, fp8_dtype, pow2)
    return _ref.quantize_rowwise_and_colwise_ref(x_hp_MN, fp8_dtype, pow2)


@torch.library.triton_op("elastic_fp8::transpose", mutates_args=())
def transpose_op(x_MN: torch.Tensor) -> torch.Tensor:
    if _on_gpu(x_MN):
        return _t.transpose_triton(x_MN)
    return x_MN.t().contiguous()


@torch.library.triton_op("elastic_fp8::quantize_rowwise_group_scaled", mutates_args=())
def quantize_rowwise_group_scaled_op(
    x_hp_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_gpu(x_hp_MN):
        return _q.quantize_rowwise_group_scaled_triton(x_hp_MN, mul_GN, gid_M, fp8_dtype, pow2)
    return _ref.quantize_rowwise_group_scaled_ref(x_hp_MN, mul_GN, gid_M, fp8_dtype, pow2)


@torch.library.triton_op("elastic_fp8::cast_rows_transposed_batched", mutates_args=())
def cast_rows_transposed_batched_op(x_hp_BRC: torch.Tensor, scale_BR: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    if _on_gpu(x_hp_BRC):
        return _t.cast_rows_transposed_batched_triton(x_hp_BRC, scale_BR, fp8_dtype)
    return _ref.cast_rows_transposed_batched_ref(x_hp_BRC, scale_BR, fp8_dtype)
