"""A Hugging Face checkpoint directory on disk: reading and checking it without loading a weight, reading one tensor
(or some of its rows) at a time through memory-mapped safetensors files, and writing safetensors shards one tensor
at a time.

The safetensors format: 8 bytes little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets:
[begin, end]}, "__metadata__": {...}}, offsets relative to the data that follows), then the tensors' bytes.
Knowing every tensor's name, shape and dtype before any data is what lets a shard be written with one tensor in
memory: the header goes first, then each tensor as it is produced.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orchestration.interop.layout import (
    HF_DTYPES,
    IGNORED_SUFFIXES,
    LayoutError,
    TensorMap,
    hf_shapes,
)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPE_CODES = {dtype: code for code, dtype in HF_DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class HfTensor:
    file: str  # name of the .safetensors file in the directory
    dtype: str  # safetensors code: F32, BF16, F16
    shape: tuple[int, ...]
    offset: int = 0  # of its first byte in the file


@dataclass
class HfCheckpoint:
    """A checked checkpoint directory: its config.json and where each tensor is."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, HfTensor]
    index_file: str | None  # INDEX_FILE, or None for a single model.safetensors
    provenance: dict[str, Any] = field(default_factory=dict)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_header(path: Path) -> tuple[dict[str, HfTensor], bytes]:
    """The tensors of one .safetensors file and its raw header; LayoutError naming the file when it is not a
    complete safetensors file (cut short, a header that does not parse, offsets past its end)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise LayoutError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise LayoutError(f"{path}: header of {n} bytes does not fit the file's {size} bytes (truncated?)")
            raw = f.read(n)
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{path}: the safetensors header is not JSON ({exc}); the file is damaged") from None
    data_bytes = size - 8 - n
    out: dict[str, HfTensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            shape = tuple(int(d) for d in meta["shape"])
            dtype = meta["dtype"]
        except (KeyError, TypeError, ValueError):
            raise LayoutError(f"{path}: tensor {name} has a malformed header entry {meta!r}") from None
        itemsize = HF_DTYPES[dtype].itemsize if dtype in HF_DTYPES else None
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise LayoutError(f"{path}: tensor {name} has {end - begin} bytes for shape {list(shape)} {dtype}; "
                              "the file is damaged")
        if end > data_bytes:
            raise LayoutError(f"{path}: tensor {name} ends at byte {end} of the data but the file holds {data_bytes} "
                              "(truncated: copy the file again)")
        out[name] = HfTensor(path.name, dtype, shape, 8 + n + begin)
    return out, raw


def open_checkpoint(root: str | Path) -> HfCheckpoint:
    """Read config.json and every shard's header; LayoutError naming the file or tensor that is missing or damaged.
    Reads no weight."""
    root = Path(root)
    if not root.is_dir():
        raise LayoutError(f"{root} is not a directory")
    config_path = root / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LayoutError(f"{config_path} is missing (a Hugging Face checkpoint directory has config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{config_path}: cannot read it ({exc})") from None
    if not isinstance(config, dict):
        raise LayoutError(f"{config_path} is not a JSON object")
    provenance = {"path": str(root.resolve()), "config_sha256": sha256_file(config_path)}
    index_path = root / INDEX_FILE
    tensors: dict[str, HfTensor] = {}
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LayoutError(f"{index_path}: not a safetensors index with a weight_map ({exc})") from None
        provenance["index_sha256"] = sha256_file(index_path)
        files = sorted(set(weight_map.values()))
        for name in files:
            if Path(name).name != name or not (root / name).is_file():
                tensor = next(t for t, f in weight_map.items() if f == name)
                raise LayoutError(f"{index_path} names file {name} (tensor {tensor}, ...) but {root / name} is missing")
        headers = {name: read_header(root / name) for name in files}
        for tensor, name in weight_map.items():
            if tensor not in headers[name][0]:
                raise LayoutError(f"{index_path} puts tensor {tensor} in {name}, but that file does not hold it")
            tensors[tensor] = headers[name][0][tensor]
        index_file: str | None = INDEX_FILE
    elif (root / SINGLE_FILE).is_file():
        tensors, raw = read_header(root / SINGLE_FILE)
        provenance["header_sha256"] = hashlib.sha256(raw).hexdigest()
        index_file = None
    else:
        raise LayoutError(f"{root} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    return HfCheckpoint(root, config, tensors, index_file, provenance)


def check_tensors(ckpt: HfCheckpoint, maps: list[TensorMap], our_shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the layout needs is there with its shape and a float dtype, and nothing else is; LayoutError
    naming the first tensor that is not."""
    needed: set[str] = set()
    for tmap in maps:
        for name, shape in zip(tmap.hf, hf_shapes(tmap, our_shapes[tmap.ours]), strict=True):
            needed.add(name)
            info = ckpt.tensors.get(name)
            if info is None:
                raise LayoutError(f"{ckpt.root}: tensor {name} is missing (the {ckpt.config.get('architectures')} "
                                  "layout of config.json needs it)")
            if info.shape != shape:
                raise LayoutError(f"{ckpt.root}: tensor {name} in {info.file} has shape {list(info.shape)}, "
                                  f"config.json implies {list(shape)}")
            if info.dtype not in HF_DTYPES:
                raise LayoutError(f"{ckpt.root}: tensor {name} in {info.file} has dtype {info.dtype}; supported: "
                                  f"{sorted(HF_DTYPES)}")
    extra = sorted(n for n in ckpt.tensors if n not in needed and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise LayoutError(f"{ckpt.root}: tensor {extra[0]} ({len(extra)} unexpected in all) is not part of the "
                          "layout config.json describes: another architecture or another config.json")


class TensorReader:
    """Reads tensors (or rows of them) from a checked checkpoint: only the bytes asked for, straight into a new
    tensor. Not through a memory map (safetensors' safe_open): the pages of a map that a read touched stay resident
    until it is unmapped, so an import through maps kept whole shards in the process's memory next to the model
    (BENCHMARKS.md, Hugging Face import and export). Rows of a row-major tensor are one contiguous byte range."""

    def __init__(self, ckpt: HfCheckpoint):
        self.ckpt = ckpt
        self._files: dict[str, Any] = {}

    def _file(self, name: str) -> Any:
        if name not in self._files:
            self._files[name] = open(self.ckpt.root / name, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        return self._files[name]

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        info = self.ckpt.tensors[name]
        dtype = HF_DTYPES[info.dtype]
        rows = info.shape[0] if info.shape else 1
        start, stop = (0, rows) if start is None else (start, min(stop, rows))
        row_bytes = math.prod(info.shape[1:]) * dtype.itemsize
        out = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        view = memoryview(out.numpy()).cast("B")
        f, done = self._file(info.file), 0
        while done < len(view):
            n = os.preadv(f.fileno(), [view[done:]], info.offset + start * row_bytes + done)
            if n <= 0:
                raise LayoutError(f"{self.ckpt.root / info.file}: ended inside tensor {name} (truncated?)")
            done += n
        shape = (stop - start, *info.shape[1:]) if info.shape else ()
        return out.view(dtype).reshape(shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# ---------------------------------------------------------------------------------------------------------------
# Writing


def shard_plan(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> list[list[int]]:
    """Entry indices per shard, in order: a new shard starts where the next tensor would take the current one past
    max_shard_bytes (a tensor larger than the limit gets a shard of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _header_bytes(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def write_shards(out: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int) -> dict[str, str]:
    """Write `entries` (name, shape, dtype) as safetensors shards in `out`; `tensors` yields (name, tensor) in the
    same order, one at a time. Returns the weight map (tensor -> file)."""
    plan = shard_plan(entries, max_shard_bytes)
    stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    weight_map: dict[str, str] = {}
    for shard_index, members in enumerate(plan):
        name = shard_name(shard_index, len(plan))
        shard_entries = [entries[i] for i in members]
        header = _header_bytes(shard_entries)
        with open(out / name, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for entry_name, shape, dtype in shard_entries:
                got_name, tensor = next(stream)
                if got_name != entry_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise AssertionError(f"tensor stream out of step: {got_name} {tuple(tensor.shape)} {tensor.dtype}"
                                         f" where {entry_name} {shape} {dtype} was planned")
                f.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
                weight_map[entry_name] = name
            f.flush()
            os.fsync(f.fileno())
    return weight_map


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
