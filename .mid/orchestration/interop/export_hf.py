"""A run's DCP checkpoint written as a Hugging Face checkpoint directory, one of our parameters in memory at a time.

Every output tensor's name, shape and dtype is known from the DCP metadata before any weight is read, so each
safetensors shard's header is written first and its tensors streamed after it (files.write_shards). The directory is
assembled under a temporary name beside `out` and renamed into place at the end: a failed export leaves nothing.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from orchestration.interop.files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    write_json,
    write_shards,
)
from orchestration.interop.layout import LayoutError, exportable, hf_config_from_args, hf_shapes, tensor_maps, to_hf

MODEL_PREFIX = "model."  # the model's tensors sit under "model" in our checkpoints' state dict (checkpoint/state.py)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def dcp_tensors(dcp_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor of a DCP checkpoint, by flattened key ("model.layers.0.attention.wq.weight")."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
    return {key: (tuple(meta.size), meta.properties.dtype) for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


def load_tensor(dcp_dir: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One full tensor of a DCP checkpoint (all the ranks' shards of it), read alone."""
    tensor = torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(str(dcp_dir)))
    return tensor


def export_checkpoint(dcp_dir: str | Path, family: str, args: Any, out: str | Path, dtype: torch.dtype,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra_files: list[Path] | None = None,
                      generation_config: dict[str, Any] | None = None,
                      config_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the model tensors of the DCP checkpoint `dcp_dir` (a model with `family` and `args`) to the directory
    `out`, which must not exist yet (or be empty): shards, index, config.json (plus `config_extra`, e.g. special token
    ids), generation_config.json and `extra_files` (copied). Returns what was written. LayoutError when the checkpoint
    does not hold the model's tensors."""
    t0 = time.perf_counter()
    dcp_dir, out = Path(dcp_dir), Path(out)
    exportable(family, args)
    saved = dcp_tensors(dcp_dir)
    maps = tensor_maps(family, args)
    entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for tmap in maps:
        key = MODEL_PREFIX + tmap.ours
        if key not in saved:
            raise LayoutError(f"checkpoint {dcp_dir.parent} has no tensor {key}: it was saved by another model than "
                              "its run's config.yaml describes")
        entries += [(name, shape, dtype) for name, shape in zip(tmap.hf, hf_shapes(tmap, saved[key][0]), strict=True)]

    def tensors():
        for tmap in maps:
            key = MODEL_PREFIX + tmap.ours
            ours = load_tensor(dcp_dir, key, *saved[key])
            for name, part in zip(tmap.hf, to_hf(tmap, ours), strict=True):
                yield name, part.to(dtype)
            del ours

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        weight_map = write_shards(tmp, entries, tensors(), max_shard_bytes)
        total = sum(torch.Size(shape).numel() * dt.itemsize for _, shape, dt in entries)
        write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        write_json(tmp / CONFIG_FILE, {**hf_config_from_args(family, args, dtype), **(config_extra or {})})
        write_json(tmp / GENERATION_CONFIG_FILE, generation_config or {})
        for path in extra_files or []:
            shutil.copyfile(path, tmp / path.name)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "tensors": len(entries), "shards": len(set(weight_map.values())), "bytes": total,
            "seconds": round(time.perf_counter() - t0, 3)}
