"""Compute copies of weights, made once per weight change instead of at every GEMM (what the layers read of them:
fp8.compute_weight).

Why: the models keep float32 master weights, and under bf16 autocast every GEMM cast its weight to bf16 again - in
the forward, in the forward activation checkpointing re-runs, in every micro-batch - and an FP8 layer cast that to
fp8 once more, plus a second layout for its backward. The weights change once per optimizer step.

attach_weight_copies(model, dtype) gives every GEMM weight that the model holds as a plain tensor in another dtype
(nn.Linear and Float8Linear weights, the grouped experts' 3D weights):
  - a `dtype` copy, a buffer beside it that the Parameter names (fp8.compute_weight.COPY_ATTR) so that
    optim.ChunkedAdamW writes it in the launch that updates the master;
  - for FP8 layers (Float8Linear, converted grouped experts) its fp8 operands in the layouts the forward and the
    backward GEMMs read, derived from the copy with the layer's own casts (bit for bit what the layer would make).
Plain nn.Linear modules become fp8.compute_weight.CopyReadingLinear. Weights that FSDP2 shards (DTensors) get no
copy: FSDP2's mixed-precision all-gather makes their compute copy once per gather, and the FP8 all-gather
(fp8.fsdp_allgather) their fp8 one from the global amax, which a copy of one shard could not know.

Freshness, one rule, checked by WeightCopies.sync() before every forward of the model (a forward pre-hook):
  - a master whose version counter or storage moved (any in-place torch op on it: a checkpoint or rollback load, an
    HF import, torch's AdamW, a fault that corrupts weights) gets its copy and its fp8 operands re-made from it;
  - a copy whose version counter moved (optim.ChunkedAdamW wrote it beside the master and said so with
    torch.autograd.graph.increment_version) gets its fp8 operands re-made from it.
Precision switches (fp8.set_precision) change no weight, and the fp8 operands are kept current in either precision,
so a switch back to fp8 reads current operands.

Memory (copy_bytes): per weight element, the copy's dtype size (2 for bf16), plus 2 for an FP8 layer's operands
(one fp8 byte per layout, two layouts) and their scales. The transient cast copies the GEMMs made before are gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fp8 import quant
from fp8.backend import get_backend
from fp8.compute_weight import COPY_ATTR, COPY_SUFFIX, CopyReadingLinear, Fp8Operands, register_grouped_operands
from fp8.convert import is_fp8_grouped, is_grouped_experts
from fp8.grouped import _POW2 as GROUPED_POW2
from fp8.linear import Float8Linear

_WEIGHTS_ATTR = "_weight_copies"  # the WeightCopies of a model, on its root module


@dataclass
class _Copy:
    """One weight's copies and the version counters they were made at."""

    module: nn.Module
    name: str
    master: nn.Parameter
    copy: torch.Tensor
    kind: str  # "linear" | "grouped" | "" (no fp8 operands)
    operands: Fp8Operands | None
    master_version: int = -1
    master_ptr: int = 0
    copy_version: int = -1


def _plain(p: torch.Tensor) -> bool:
    # A DTensor (FSDP2 shard) or a wrapper subclass (the FP8 all-gather's) keeps its compute copies elsewhere.
    return type(p.data) is torch.Tensor


# Linears whose weight is read as the master, not through a GEMM on it: MoE routers compute their logits in float32
# from the master (models.deepseek_moe.MoE.forward), so a copy of theirs would never be read.
_READ_AS_MASTER = frozenset({"gate", "router"})


def _weights(model: nn.Module):
    """(module, parameter name, fp8 kind) of every GEMM weight, each parameter once."""
    seen = set()
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in _READ_AS_MASTER:
            continue
        if isinstance(module, nn.Linear):
            found = [("weight", "linear" if isinstance(module, Float8Linear) else "")]
        elif is_grouped_experts(module):
            kind = "grouped" if is_fp8_grouped(module) else ""
            found = [(n, kind) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        else:
            continue
        for name, kind in found:
            p = getattr(module, name)
            if id(p) not in seen:
                seen.add(id(p))
                yield module, name, kind


def _register(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    module.register_buffer(name, tensor, persistent=False)


def _linear_operands(module: Float8Linear, copy_NK: torch.Tensor) -> tuple:
    """(data, scale, data_t, scale_t) as _Fp8LinearFn would cast the bf16 weight (fp8.compute_weight's layouts)."""
    e4m3, pow2 = get_backend(copy_NK.device).e4m3, module.recipe.pow2_scales
    if module.recipe.granularity == "tensorwise":
        data, scale = quant.quantize_tensorwise(copy_NK, e4m3, pow2)
        return data, scale, quant.transpose(data), None
    return quant.quantize_rowwise_and_colwise(copy_NK, e4m3, pow2)


def _grouped_operands(copy_ENK: torch.Tensor) -> tuple:
    """(data [E, N, K], scale [E, 1, N], data_t [E, K, N], None) as fp8.grouped casts the [E, K, N] view."""
    e4m3 = get_backend(copy_ENK.device).e4m3
    w_EKN = copy_ENK.transpose(-2, -1)
    w_fp8_EKN, sw_E1N = quant.quantize_colwise_3d(w_EKN, e4m3, GROUPED_POW2)
    q_EKN = quant.cast_rows_transposed_batched(copy_ENK, sw_E1N.reshape(sw_E1N.shape[0], -1), e4m3)
    return w_fp8_EKN.transpose(-2, -1), sw_E1N, q_EKN, None


_OPERAND_FIELDS = (("data", "_fp8"), ("scale", "_fp8_scale"), ("data_t", "_fp8_t"), ("scale_t", "_fp8_scale_t"))


def _set_operands(module: nn.Module, name: str, operands: Fp8Operands, kind: str) -> None:
    """Make the weight's fp8 operands from its copy and put them in place of the old ones (buffers and `operands`).
    New tensors rather than writes into the old ones: the casts allocate their outputs, and a copy into the old
    buffers would be a second pass over them. The compiled layers read the buffers by name at every call, and the
    new tensors have the old ones' shapes, strides and dtypes (no recompile)."""
    copy = getattr(module, name + COPY_SUFFIX)
    made = _linear_operands(module, copy) if kind == "linear" else _grouped_operands(copy)
    for (field, suffix), t in zip(_OPERAND_FIELDS, made):
        setattr(operands, field, t)
        setattr(module, name + suffix, t)


class WeightCopies:
    """The copies of one model's weights (see the module docstring)."""

    def __init__(self, entries: list[_Copy]) -> None:
        self.entries = entries
        self.refreshes = 0  # copies re-made from their master (tests read it)
        self.fp8_refreshes = 0  # fp8 operands re-made from their copy alone

    @torch.no_grad()
    def sync(self) -> None:
        """Re-make every copy whose master changed since it was made, and the fp8 operands of every copy that
        changed (see the module docstring). Cheap when nothing changed: a comparison of counters per weight."""
        for e in self.entries:
            master = e.master
            if master._version != e.master_version or master.data_ptr() != e.master_ptr:
                e.copy.copy_(master)
                self._make_operands(e)
                e.master_version, e.master_ptr = master._version, master.data_ptr()
                e.copy_version = e.copy._version
                self.refreshes += 1
            elif e.copy._version != e.copy_version:
                if e.operands is not None:
                    self._make_operands(e)
                    self.fp8_refreshes += 1
                e.copy_version = e.copy._version

    @staticmethod
    def _make_operands(e: _Copy) -> None:
        if e.operands is not None:
            _set_operands(e.module, e.name, e.operands, e.kind)



def copy_bytes(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes attach_weight_copies(model, dtype) allocates, from shapes alone (a meta-device model works): what the
    memory plan counts. Weights FSDP2 shards are not counted (they get no copy); on a meta-built model, which is
    unsharded, the caller counts nothing when the run shards."""
    total = 0
    for module, name, kind in _weights(model):
        w = getattr(module, name)
        if not _plain(w) or w.dtype == dtype or not w.is_floating_point():
            continue
        total += w.numel() * dtype.itemsize
        if kind == "linear":
            n, k = w.shape
            scales = 1 if module.recipe.granularity == "tensorwise" else n + k
            total += 2 * w.numel() + 4 * scales
        elif kind == "grouped":
            e, n, _ = w.shape
            total += 2 * w.numel() + 4 * e * n
    return total


def attach_weight_copies(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> WeightCopies | None:
    """Give `model`'s GEMM weights their compute copies in `dtype` (see the module docstring) and keep them fresh
    before every forward. Call after the weights are materialized and before torch.compile traces the model; build
    the optimizer after it or before, either way (the optimizer finds the copies on the parameters). Returns None
    when no weight needs one (all sharded by FSDP2, or already in `dtype`). Attaching twice is an error."""
    if getattr(model, _WEIGHTS_ATTR, None) is not None:
        raise ValueError("weight copies are already attached to this model")
    entries = []
    for module, name, kind in _weights(model):
        master = getattr(module, name)
        if not _plain(master) or master.dtype == dtype or not master.is_floating_point():
            continue
        copy = torch.empty(master.shape, dtype=dtype, device=master.device)
        _register(module, name + COPY_SUFFIX, copy)
        setattr(master, COPY_ATTR, copy)
        operands = None
        if kind:
            for _, suffix in _OPERAND_FIELDS:
                _register(module, name + suffix, None)
            operands = Fp8Operands(None, None, None, None)  # made by the first sync, below
            if kind == "grouped":
                register_grouped_operands(copy.transpose(-2, -1), operands)
        if type(module) is nn.Linear:
            module.__class__ = CopyReadingLinear
        entries.append(_Copy(module, name, master, copy, kind, operands))
    if not entries:
        return None
    copies = WeightCopies(entries)
    copies.sync()
    setattr(model, _WEIGHTS_ATTR, copies)
    model.register_forward_pre_hook(lambda _module, _args: copies.sync())
    return copies


def weight_copies(model: nn.Module) -> WeightCopies | None:
    """The WeightCopies attached to `model`, or None."""
    return getattr(model, _WEIGHTS_ATTR, None)
