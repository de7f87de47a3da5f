"""torch.library custom ops (namespace "elastic_fp8") around the Triton quantize kernels.

Why custom ops: torch.compile cannot trace into a Triton launcher that allocates and reads tensor metadata on the
host; an opaque op with a fake (meta) implementation lets Dynamo/Inductor keep the surrounding graph whole and
call the kernel as one node. The ops carry no autograd formula: quantization is called inside the FP8 linear's
autograd.Function, where grad mode is off.

Each op runs the Triton kernel when Triton can run on the input's device (CUDA/ROCm, or CPU under the
interpreter) and the pure-PyTorch reference otherwise, so a compiled model also runs on a CPU-only machine.
In eager mode fp8.kernels calls the launchers directly (the dispatcher costs host time); these ops are what
torch.compile sees.
"""

from __future__ import annotations

import torch

from . import quantize as _q
from . import reference as _ref


def _fp8_like(shape, x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=fp8_dtype, device=x.device)


def _fp32(shape, x: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=x.device)


@torch.library.custom_op("elastic_fp8::quantize_tensorwise", mutates_args=())
def quantize_tensorwise_op(
    x_hp: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if _q.triton_usable(x_hp):
        return _q.quantize_tensorwise_triton(x_hp, fp8_dtype, amax)
    return _ref.quantize_tensorwise_ref(x_hp, fp8_dtype, amax)


@quantize_tensorwise_op.register_fake
def _(x_hp, fp8_dtype, amax):
    return _fp8_like(x_hp.shape, x_hp, fp8_dtype), _fp32((), x_hp)


@torch.library.custom_op("elastic_fp8::quantize_rowwise", mutates_args=())
def quantize_rowwise_op(x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _q.triton_usable(x_hp_MN):
        return _q.quantize_rowwise_triton(x_hp_MN, fp8_dtype, pow2)
    return _ref.quantize_rowwise_ref(x_hp_MN, fp8_dtype, pow2)


@quantize_rowwise_op.register_fake
def _(x_hp_MN, fp8_dtype, pow2):
    M, N = x_hp_MN.shape
    return _fp8_like((M, N), x_hp_MN, fp8_dtype), _fp32((M, 1), x_hp_MN)


@torch.library.custom_op("elastic_fp8::quantize_rowwise_and_colwise", mutates_args=())
def quantize_rowwise_and_colwise_op(
    x_hp_MN: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _q.triton_usable(x_hp_MN):
        return _q.quantize_rowwise_and_colwise_triton(x_hp_MN, fp8_dtype, pow2)
    return _ref.quantize_rowwise_and_colwise_ref(x_hp_MN, fp8_dtype, pow2)


@quantize_rowwise_and_colwise_op.register_fake
def _(x_hp_MN, fp8_dtype, pow2):
    M, N = x_hp_MN.shape
    return (
        _fp8_like((M, N), x_hp_MN, fp8_dtype),
        _fp32((M, 1), x_hp_MN),
        _fp8_like((N, M), x_hp_MN, fp8_dtype),
        _fp32((1, N), x_hp_MN),
    )


@torch.library.custom_op("elastic_fp8::quantize_jagged_per_expert", mutates_args=())
def quantize_jagged_per_expert_op(
    x_hp_MK: torch.Tensor, offs_E: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool, transpose_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if _q.triton_usable(x_hp_MK):
        return _q.quantize_jagged_per_expert_triton(x_hp_MK, offs_E, fp8_dtype, pow2, transpose_out)
    return _ref.quantize_jagged_per_expert_ref(x_hp_MK, offs_E, fp8_dtype, pow2, transpose_out)


@quantize_jagged_per_expert_op.register_fake
def _(x_hp_MK, offs_E, fp8_dtype, pow2, transpose_out):
    M, K = x_hp_MK.shape
    E = offs_E.shape[0]
    return _fp8_like((K, M) if transpose_out else (M, K), x_hp_MK, fp8_dtype), _fp32((E, K), x_hp_MK)
