"""torch.library Triton ops (namespace "elastic_fp8") around the cast kernels: what torch.compile'd code calls.

Why `torch.library.triton_op` (and not an opaque custom op): Inductor traces the op's body, sees each Triton
kernel through `wrap_triton`, and launches it from its generated code like its own kernels. An opaque custom op
instead costs a Python dispatch and a Triton JIT launch per call at run time, which left the GPU idle waiting for
host launches (BENCHMARKS.md, "Tried, did not pay"). The ops carry no autograd formula: quantization is called
inside the FP8 modules' autograd.Functions, where grad mode is off.

fp8.quant decides when an op runs (compiled code, the casts it keeps as kernels there) and calls it on GPU tensors.
An op still has to trace on any device, fake tensors included (torch.library.opcheck, a compile on CPU under the
interpreter): off the GPU its body is the cast's reference (fp8.reference.<cast>_ref), never the kernel.
"""

from __future__ import annotations

import torch

from fp8 import reference

from . import quantize as _q
from . import transposed as _t


def _kernel_or_reference(name: str, launcher, x: torch.Tensor, *args):
    # Decided on the device alone, so the same branch is taken for a real tensor and for its fake twin
    # while Inductor traces the body.
    return launcher(x, *args) if x.is_cuda else getattr(reference, f"{name}_ref")(x, *args)


@torch.library.triton_op("elastic_fp8::quantize_tensorwise", mutates_args=())
def quantize_tensorwise_op(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernel_or_reference("quantize_tensorwise", _q.quantize_tensorwise_triton, x_hp, fp8_dtype, amax)


@torch.library.triton_op("elastic_fp8::quantize_rowwise", mutates_args=())
def quantize_rowwise_op(x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernel_or_reference("quantize_rowwise", _q.quantize_rowwise_triton, x_hp_MN, fp8_dtype, pow2)


@torch.library.triton_op("elastic_fp8::quantize_rowwise_and_colwise", mutates_args=())
def quantize_rowwise_and_colwise_op(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernel_or_reference("quantize_rowwise_and_colwise", _q.quantize_rowwise_and_colwise_triton, x_hp_MN,
                                fp8_dtype, pow2)


@torch.library.triton_op("elastic_fp8::transpose", mutates_args=())
def transpose_op(x_MN: torch.Tensor) -> torch.Tensor:
    return _kernel_or_reference("transpose", _t.transpose_triton, x_MN)


@torch.library.triton_op("elastic_fp8::quantize_rowwise_group_scaled", mutates_args=())
def quantize_rowwise_group_scaled_op(
    x_hp_MN: torch.Tensor, mul_GN: torch.Tensor, gid_M: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernel_or_reference("quantize_rowwise_group_scaled", _q.quantize_rowwise_group_scaled_triton, x_hp_MN,
                                mul_GN, gid_M, fp8_dtype, pow2)


@torch.library.triton_op("elastic_fp8::cast_rows_transposed_batched", mutates_args=())
def cast_rows_transposed_batched_op(x_hp_BRC: torch.Tensor, scale_BR: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return _kernel_or_reference("cast_rows_transposed_batched", _t.cast_rows_transposed_batched_triton, x_hp_BRC,
                                scale_BR, fp8_dtype)
