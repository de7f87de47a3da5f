"""What a GEMM reads of a weight: its compute copy where one is attached (fp8.weight_copies), else the master.

The models keep float32 master weights; a matmul under bf16 autocast casts its weight to bf16 at every use, and an
FP8 layer then casts that to fp8 (in two layouts for backward). fp8.weight_copies keeps those casts as buffers beside
each weight, refreshed when the weight changes (once per optimizer step), and the layers read them through here:

    compute_weight(module, name, x)   the weight in the dtype x's GEMM computes in: the bf16 copy (gradients flow to
                                      the master as through a cast), or the master itself when there is no copy of
                                      that dtype (the caller casts it as before)
    fp8_operands(module, name, x)     an FP8 linear's weight operands or None
    grouped_fp8_operands(w_EKN)       an FP8 grouped GEMM's weight operands, looked up by the bf16 copy it was given
                                      (the grouped GEMM's custom op sees tensors, not modules) or None

Buffer names on the module that owns weight `name` (non-persistent: checkpoints do not change):
    <name>_compute                    the compute-dtype copy, same shape as the master
    <name>_fp8, <name>_fp8_scale      the forward GEMM's operand and its scales
    <name>_fp8_t, <name>_fp8_scale_t  the operand in the layout (and scaling) the backward's grad-input GEMM reads
Linear [N, K]: tensorwise: data [N, K], scale 0-d, data_t [K, N] (same scale); rowwise: data [N, K] row-scaled
(scale [N, 1]), data_t [K, N] column-scaled (scale_t [1, K]). Grouped experts stored [E, N, K] (nn.Linear's
[out, in] per expert; the GEMMs read the [E, K, N] transposed view): data [E, N, K] (the column-major [E, K, N]
operand, scaled per expert and output column n along K, scale [E, 1, N]), data_t [E, K, N] row-major, the same
weight recast by those scales (fp8.grouped's grad-input GEMM), scale_t None.

Every operand is derived exactly as the layer's own cast of the bf16 weight would make it (fp8.weight_copies), so the
numerics are the uncopied layer's bit for bit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

COPY_SUFFIX = "_compute"
# The attribute on a master Parameter naming its compute copy: optim.ChunkedAdamW writes the copy in the launch that
# updates the master.
COPY_ATTR = "compute_copy"


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on x computes in: autocast's where it is on (as the matmul it stands for would), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _ReadCopy(torch.autograd.Function):
    """The copy in the forward; in backward the gradient goes to the master in the master's dtype, as through the
    cast the copy stands for (ToCopyBackward)."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.master_dtype), None


def compute_weight(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """module.<name> for a GEMM on x: its compute copy when one of x's compute dtype is attached, else the master."""
    master = getattr(module, name)
    copy = getattr(module, name + COPY_SUFFIX, None)
    if copy is None or copy.dtype != compute_dtype(x):
        return master
    return _ReadCopy.apply(master, copy)


@dataclass
class Fp8Operands:
    """A weight's fp8 GEMM operands (layouts in the module docstring)."""

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor
    scale_t: torch.Tensor | None


def fp8_operands(module: nn.Module, name: str, x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple | None:
    """An FP8 linear's attached weight operands (data, scale, data_t, scale_t), where they were derived from the copy
    of x's compute dtype in `fp8_dtype`; else None (the layer casts its weight itself). A tuple, not Fp8Operands:
    this runs inside torch.compile'd blocks."""
    data = getattr(module, name + "_fp8", None)
    copy = getattr(module, name + COPY_SUFFIX, None)
    if data is None or copy is None or copy.dtype != compute_dtype(x) or data.dtype != fp8_dtype:
        return None
    return (data, getattr(module, name + "_fp8_scale"), getattr(module, name + "_fp8_t"),
            getattr(module, name + "_fp8_scale_t", None))


# The grouped GEMM runs as an opaque custom op whose body sees the weight operand as a plain tensor: the [E, K, N]
# view of a bf16 copy. Its fp8 operands are found by that view's storage and geometry (unique while the copy lives:
# the entry dies with the module that holds the copy and its operands).
_GROUPED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _view_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def register_grouped_operands(copy_view_EKN: torch.Tensor, operands: Fp8Operands) -> None:
    """Make `operands` what grouped_fp8_operands returns for the [E, K, N] view of a bf16 copy."""
    _GROUPED[_view_key(copy_view_EKN)] = operands


def grouped_fp8_operands(w_EKN: torch.Tensor, fp8_dtype: torch.dtype) -> Fp8Operands | None:
    """The fp8 operands of a grouped weight given as the [E, K, N] view of its attached bf16 copy, in `fp8_dtype`;
    None for any other tensor (the grouped GEMM casts it itself)."""
    if not _GROUPED:
        return None
    found = _GROUPED.get(_view_key(w_EKN))
    if found is None or found.data is None or found.data.dtype != fp8_dtype:
        return None
    return found


class CopyReadingLinear(nn.Linear):
    """nn.Linear whose GEMM reads its weight through compute_weight. fp8.weight_copies gives plain nn.Linear modules
    this class in place when it attaches their copies (same parameters, hooks and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, compute_weight(self, "weight", x), self.bias)
