"""FP8 all-gather of tensorwise weights under FSDP2: the weights travel as fp8, one byte per element.

FSDP2 all-gathers every weight before a block's forward (and again before its backward). With
`enable_fp8_all_gather(model)` each tensorwise Float8Linear weight becomes an `Fp8AllGatherWeight`: the sharded
high-precision master, whose FSDP2 extension points (`fsdp_pre_all_gather` / `fsdp_post_all_gather`, the
tensor-subclass hooks torch.distributed.fsdp documents) cast the local shard to fp8 before the collective. The
scale is the one the unsharded weight would get: the amax of every shard, all-reduced (MAX) over the FSDP mesh,
so the fp8 bytes each rank sends are exactly those the full weight would cast to. The amaxes of one FSDP2 unit's
weights (a Llama3 block's wq wk wv wo w1 w2 w3) travel together: one all-reduce of the stacked amaxes per unit
all-gather instead of one per weight (7 -> 1 per block, forward and backward re-gather; MAX is exact, so the scales
are those of the per-weight all-reduces bit for bit). The gathered weight is an
`Fp8GatheredWeight` (fp8 data + that scale); Float8Linear's forward and backward GEMMs read its fp8 data directly
(fp8.linear), never casting the weight again.

Bytes per all-gather: 1 per weight element instead of 2 (bf16 param_dtype) or 4 (float32).

Precision switches (fp8.set_precision, the divergence fallback) stay exact: a layer in high precision gathers its
master weight in param_dtype, the unconverted computation. FSDP2 sizes its gather buffers on the first all-gather,
so a layer whose gather changes between fp8 and high precision has those buffers dropped (FSDPParam state, the
one private FSDP2 detail used here) and re-made at the new size on the next all-gather.

Checkpoints hold the plain master tensors (a state-dict hook unwraps them): a run saved with the fp8 all-gather
loads into one without it, at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fp8 import reference
from fp8.backend import get_backend
from fp8.weight_amax import fresh_weight_amax

aten = torch.ops.aten

# Ops whose result is still the same weight (FSDP2's sharding, padding and materialization: views, slices, copies,
# empty/zero buffers of its shape): the result stays wrapped so FSDP2 finds the extension points on the shard.
# Every other op (the optimizer's arithmetic, norms) sees and returns the plain master tensor.
_OPS_KEEPING_THE_WRAPPER = {
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor, aten.copy_.default,
    aten.view.default, aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.clone.default, aten.narrow.default, aten.alias.default,
    aten.detach.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """A high-precision master weight (`hp`) that FSDP2 all-gathers in fp8 while its layer computes in fp8.

    pow2: round the scale down to a power of two (the layer's recipe.pow2_scales), as the layer's own cast would.
    """

    hp: torch.Tensor
    pow2: bool

    @staticmethod
    def __new__(cls, hp: torch.Tensor, pow2: bool):
        return torch.Tensor._make_wrapper_subclass(
            cls, hp.size(), strides=hp.stride(), storage_offset=hp.storage_offset(), dtype=hp.dtype,
            layout=hp.layout, device=hp.device, requires_grad=hp.requires_grad)

    def __init__(self, hp: torch.Tensor, pow2: bool):
        self.hp = hp
        self.pow2 = pow2

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight(pow2={self.pow2}, hp={self.hp!r})"

    @property
    def fp8_all_gather_master(self) -> torch.Tensor:
        """The plain master tensor (what optimizers that address storage directly update: optim.ChunkedAdamW)."""
        return self.hp

    def __tensor_flatten__(self):
        return ["hp"], {"pow2": self.pow2}

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: dict, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["hp"], meta["pow2"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        pow2 = next(a.pow2 for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.hp, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _OPS_KEEPING_THE_WRAPPER:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, pow2), out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module: nn.Module, mp_policy):
        """-> (all-gather inputs, metadata): the fp8 shard and its global scale while `module` computes in fp8,
        else the master shard in param_dtype (what FSDP2 gathers without this class)."""
        hp = self.hp if mp_policy.param_dtype is None else self.hp.to(mp_policy.param_dtype)
        fp8_now = _computes_in_fp8(module)
        _match_gather_buffers(module, fp8_now)
        if not fp8_now:
            return (hp,), None
        unit = module.__dict__.get(_UNIT_AMAXES)
        if unit is None:
            raise RuntimeError(f"{type(module).__name__} is all-gathered in fp8 but its FSDP2 unit is unknown: call "
                               "fp8.fsdp_allgather.track_fsdp_params(model) after fully_shard")
        amax = unit.global_amax(module, mesh, mp_policy.param_dtype)
        data, scale = reference.quantize_tensorwise_ref(hp, get_backend(hp.device).e4m3, amax=amax, pow2=self.pow2)
        return (data,), (scale,)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        (data,) = all_gather_outputs
        if out is not None:  # FSDP2 re-gathered into the storage of `out`: only the scale is new
            if metadata is not None:
                out.scale = metadata[0]
            return None
        if metadata is None:
            return data, (data,)
        return Fp8GatheredWeight(data, metadata[0], param_dtype), (data,)


class Fp8GatheredWeight(torch.Tensor):
    """An all-gathered weight as fp8 `data` with its tensorwise `scale` (x_fp8 = x * scale), standing in for a
    high-precision weight of dtype `nominal_dtype` (what autograd and the layer's gradient see). Float8Linear's GEMMs
    read data and scale directly; any other op sees the dequantized weight."""

    data_fp8: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, data_fp8: torch.Tensor, scale: torch.Tensor, nominal_dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data_fp8.size(), strides=data_fp8.stride(), storage_offset=data_fp8.storage_offset(),
            dtype=nominal_dtype, layout=data_fp8.layout, device=data_fp8.device, requires_grad=False)

    def __init__(self, data_fp8: torch.Tensor, scale: torch.Tensor, nominal_dtype: torch.dtype):
        self.data_fp8 = data_fp8
        self.scale = scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(dtype={self.dtype}, scale={self.scale}, data_fp8={self.data_fp8!r})"

    def __tensor_flatten__(self):
        return ["data_fp8", "scale"], {"nominal_dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: dict, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["data_fp8"], inner["scale"], meta["nominal_dtype"])

    def dequantized(self) -> torch.Tensor:
        return (self.data_fp8.float() / self.scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        if func in (aten.as_strided.default, aten.detach.default, aten.alias.default, aten.view.default) \
                and isinstance(w, cls):
            # FSDP2's as_strided to the parameter's shape and nn.Parameter's detach: the same fp8 bytes
            return cls(func(w.data_fp8, *args[1:], **kwargs), w.scale, w.dtype)
        if func is aten._to_copy.default and isinstance(w, cls) and set(kwargs) <= {"dtype"}:
            # The layer's cast of the weight to its compute dtype (autocast): the fp8 bytes do not change, only the
            # dtype the gradient comes back in.
            return cls(w.data_fp8, w.scale, kwargs.get("dtype", w.dtype))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantized(), (args, kwargs))
        return func(*args, **kwargs)


def gathered_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp8 data, scale) of a weight FSDP2 gathered in fp8, None for any other tensor."""
    if isinstance(w, Fp8GatheredWeight):
        return w.data_fp8, w.scale
    return None


# Attributes set on each wrapped layer: the FSDPParam of its weight and the _UnitAmaxes of its FSDP2 unit, once
# track_fsdp_params found them, and whether its gather buffers were last sized for fp8.
_FSDP_PARAM = "_fp8_all_gather_fsdp_param"
_UNIT_AMAXES = "_fp8_all_gather_unit_amaxes"
_GATHER_IS_FP8 = "_fp8_all_gather_buffers_fp8"


def _computes_in_fp8(module: nn.Module) -> bool:
    return bool(getattr(module, "fp8_enabled", True))


class _UnitAmaxes:
    """The fp8-gathered weights of one FSDP2 unit (FSDPParamGroup), in the group's order, and the global amaxes of
    the unit's all-gather in progress.

    FSDP2 builds a unit's all-gather inputs by calling fsdp_pre_all_gather on each of the unit's weights in the
    group's order, all before the collective (_fsdp_collectives._get_param_all_gather_inputs), on every rank alike. So
    the first weight computing in fp8 starts a gather: it takes the local amax of every weight that computes in fp8
    now, MAX-all-reduces them as one stacked tensor, and each weight (itself included) takes its own from `pending`.
    Nothing outlives the gather: the backward re-gather, or the next step after the optimizer changed the weights,
    starts over from the weights as they are then."""

    def __init__(self, fsdp_params: list[Any]) -> None:
        self.fsdp_params = fsdp_params
        self.pending: dict[int, torch.Tensor] = {}

    def global_amax(self, module: nn.Module, mesh: Any, param_dtype: torch.dtype | None) -> torch.Tensor:
        members = [p for p in self.fsdp_params if _computes_in_fp8(p._module_info.module)]
        if members[0]._module_info.module is module:
            amaxes = torch.stack([self._local_amax(p, param_dtype) for p in members])
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=mesh.get_group())
            self.pending = {id(p._module_info.module): amax for p, amax in zip(members, amaxes.unbind())}
        amax = self.pending.pop(id(module), None)
        if amax is None:
            raise RuntimeError(f"{type(module).__name__}: FSDP2 asked for this weight's fp8 all-gather input outside "
                               "its unit's gather (the unit's first fp8 weight starts each one)")
        return amax

    @staticmethod
    def _local_amax(fsdp_param: Any, param_dtype: torch.dtype | None) -> torch.Tensor:
        hp = fsdp_param._sharded_local_tensor.hp
        module = fsdp_param._module_info.module
        if fsdp_param.offload_to_cpu:  # as FSDPParam.all_gather_inputs moves the shard before the pre-all-gather
            amax = reference.abs_amax(hp.to(fsdp_param.device, non_blocking=True))
        elif getattr(module, "weight_amax_of", None) == "shard":
            # Kept by the optimizer step that wrote the shard (fp8.weight_amax): no pass over it, in the forward's
            # all-gather and the backward's alike.
            amax = fresh_weight_amax(module, hp, (fsdp_param.sharded_param, fsdp_param._sharded_local_tensor))
        else:
            # The padding FSDP2 adds to uneven shards is zeros: it never raises the amax.
            amax = reference.abs_amax(hp)
        if param_dtype is None or param_dtype == hp.dtype:
            return amax
        # max |x| of the weight cast to param_dtype without casting the weight: round-to-nearest-even is monotonic
        # and symmetric, so max |round(x)| == round(max |x|) bit for bit (an overflow is inf either way).
        return amax.to(param_dtype).float()


def _match_gather_buffers(module: nn.Module, fp8_now: bool) -> None:
    """Drop FSDP2's gather buffers of `module`'s weight when their size was set for the other precision."""
    last = module.__dict__.get(_GATHER_IS_FP8)
    module.__dict__[_GATHER_IS_FP8] = fp8_now
    if last is None or last == fp8_now:
        return
    fsdp_param = module.__dict__.get(_FSDP_PARAM)
    if fsdp_param is None:
        raise RuntimeError(f"{type(module).__name__} switched precision under the FP8 all-gather but its FSDP2 "
                           "parameter is unknown: call fp8.fsdp_allgather.track_fsdp_params(model) after fully_shard")
    # FSDP2 (re)allocates these on the next all-gather at the size of the inputs it then gets (FSDPParam.
    # init_all_gather_outputs / init_unsharded_param), and the unsharded parameter it makes replaces the old one on
    # the module.
    fsdp_param.all_gather_outputs = []
    fsdp_param._unsharded_inner_tensors = []
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param


def _eligible(module: nn.Module) -> bool:
    # Float8Linear declares itself eligible (its LM head subclass does not: it runs its own fused kernels on the
    # weight); asked of the class so this module needs no import of fp8.linear, which imports it.
    return (getattr(type(module), "fsdp_fp8_all_gather_eligible", False)
            and module.recipe.granularity == "tensorwise")


def _unwrap_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: the plain master tensor (a DTensor over it when sharded) instead of the wrapper."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is None:
        return
    local = getattr(value, "_local_tensor", value)
    if not isinstance(local, Fp8AllGatherWeight):
        return
    if local is value:
        state_dict[key] = local.hp
        return
    from torch.distributed.tensor import DTensor

    state_dict[key] = DTensor.from_local(local.hp, value.device_mesh, value.placements, run_check=False,
                                         shape=value.shape, stride=value.stride())


def enable_fp8_all_gather(model: nn.Module) -> list[str]:
    """Wrap every tensorwise Float8Linear weight of `model` (before fully_shard) so FSDP2 gathers it in fp8; returns
    the names of the layers wrapped. The Parameter objects are replaced (build the optimizer afterwards)."""
    wrapped = []
    for name, module in model.named_modules():
        if not _eligible(module) or isinstance(module.weight.data, Fp8AllGatherWeight):
            continue
        weight = module.weight
        module.weight = nn.Parameter(Fp8AllGatherWeight(weight.data, module.recipe.pow2_scales),
                                     requires_grad=weight.requires_grad)
        module._register_state_dict_hook(_unwrap_state_dict)
        wrapped.append(name)
    return wrapped


def track_fsdp_params(model: nn.Module) -> int:
    """After fully_shard: remember, on each wrapped layer, the FSDPParam of its weight (what a precision switch
    resets, see _match_gather_buffers) and its FSDP2 unit's _UnitAmaxes (the one all-reduce of the unit's amaxes).
    Required before the first forward. Returns how many weights were found."""
    found = 0
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if callable(get_state) else None
        wrapped = [p for p in getattr(group, "fsdp_params", []) or []
                   if _eligible(p._module_info.module) and isinstance(p._sharded_local_tensor, Fp8AllGatherWeight)]
        unit = _UnitAmaxes(wrapped)
        for fsdp_param in wrapped:
            owner = fsdp_param._module_info.module
            owner.__dict__[_FSDP_PARAM] = fsdp_param
            owner.__dict__[_UNIT_AMAXES] = unit
            found += 1
    return found


def is_fp8_all_gather_weight(t: torch.Tensor) -> bool:
    """A weight (or its shard, or a DTensor over it) that FSDP2 gathers in fp8."""
    return isinstance(getattr(t, "_local_tensor", t), Fp8AllGatherWeight)
