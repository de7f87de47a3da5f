"""Fill a model with the weights of a Hugging Face checkpoint directory.

The model is the worker's: built on meta, maybe converted to FP8, sharded by FSDP2 (dimension 0 of every parameter)
and materialized. Each rank reads only the rows of each parameter that it holds, one parameter at a time, from
memory-mapped files: host memory holds one parameter's shard (plus, for q/k, the whole heads around it) at a time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orchestration.interop.files import HfCheckpoint, TensorReader, check_tensors, open_checkpoint
from orchestration.interop.layout import (
    LayoutError,
    args_from_hf_config,
    args_of,
    exportable,
    mismatched_fields,
    rows_from_hf,
    tensor_maps,
)

# Module wrappers that insert a name between a block and its parameters (activation checkpointing).
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def meta_shapes(family: str, args: Any) -> dict[str, tuple[int, ...]]:
    """Our parameters' shapes for `args`, from a model built on the meta device (allocates nothing)."""
    from models.registry import FAMILIES

    _, model_cls = FAMILIES[family]
    with torch.device("meta"):
        model = model_cls(args)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_checkpoint(root: str | Path, family: str, args: Any) -> HfCheckpoint:
    """Open `root` and check that it holds exactly the tensors of a model with `args` (names, shapes, dtypes) and
    that its config.json describes that architecture; LayoutError naming the file, tensor or field otherwise.
    Reads headers only."""
    ckpt = open_checkpoint(root)
    hf_family, fields = args_from_hf_config(ckpt.config)
    if hf_family != family:
        raise LayoutError(f"{Path(root) / 'config.json'} architectures={ckpt.config.get('architectures')} is a "
                          f"{hf_family} model, not {family}")
    theirs = args_of(family, fields)
    diff = mismatched_fields(family, args, theirs)
    if diff:
        raise ArchitectureMismatch(*diff[0])
    exportable(family, args)  # settings the layout has no field for (DeepSeek-V3 routing) must be its fixed ones
    check_tensors(ckpt, tensor_maps(family, args), meta_shapes(family, args))
    return ckpt


class ArchitectureMismatch(LayoutError):
    """config.json describes another architecture than the model's arguments: the first field that differs."""

    def __init__(self, attr: str, key: str, ours: Any, theirs: Any):
        super().__init__(f"config.json {key}={theirs!r} but the model has {attr}={ours!r}")
        self.attr, self.key, self.ours, self.theirs = attr, key, ours, theirs


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's part of `param`, the index of its first row in the full parameter)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Shard) and p.dim != 0 for p in param.placements):
        raise NotImplementedError(f"a parameter sharded on dimension {param.placements}; FSDP2 shards dimension 0")
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), int(offset[0])


@torch.no_grad()
def import_weights(model: nn.Module, root: str | Path, family: str, args: Any) -> dict[str, Any]:
    """Copy the checkpoint's weights into `model` (each rank its own rows). Parameters only: buffers keep their
    initialisation (RoPE tables, the MoE bias of aux-loss-free balancing, which this layout does not hold: zero).
    Returns what the run records: the source's path and digests, the tensor count, the bytes read, the seconds."""
    t0 = time.perf_counter()
    ckpt = check_checkpoint(root, family, args)
    maps = tensor_maps(family, args)
    params = {name.replace(_WRAPPER_PREFIX, ""): p for name, p in model.named_parameters()}
    mapped = {tmap.ours for tmap in maps}
    unmapped = sorted(set(params) - mapped)
    if unmapped:
        raise LayoutError(f"parameter {unmapped[0]} of the model has no tensor in the {family} layout")
    reader = TensorReader(ckpt)
    bytes_read = 0
    try:
        for tmap in maps:
            param = params[tmap.ours]
            local, start = _local_rows(param)
            if local.shape[0] == 0:
                continue
            rows = rows_from_hf(tmap, reader.read, start, start + local.shape[0], tuple(param.shape))
            bytes_read += rows.numel() * rows.element_size()
            local.copy_(rows)
            del rows
    finally:
        reader.close()
    return {**ckpt.provenance, "tensors": len(maps), "bytes_read": bytes_read,
            "seconds": round(time.perf_counter() - t0, 3)}

