"""Read a run directory's offline W&B files back (for tests, the report and a restart's backfill).

wandb 0.31 ships no Python reader for them (the writer is the Go wandb-core), so we parse the record log here: a
LevelDB-style log of 32 KiB blocks holding chunked records, each chunk a 7-byte header (crc32, length, type)
and a payload; the records are `wandb.proto.wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
import logging
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"  # in the run directory: the one W&B run id of every start of the run

_LOG_BLOCK = 32 * 1024
_LOG_CHUNK_HEADER = struct.Struct("<IHB")  # crc32, payload length, chunk type
_LOG_FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version 0
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_record_payloads(path: Path) -> Iterator[bytes]:
    """Raw record payloads of one .wandb file; stops quietly at a torn tail (a killed writer)."""
    data = Path(path).read_bytes()
    ident, magic, version = _LOG_FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path} is not a W&B transaction log (header {ident!r}, {magic:#x}, {version})")
    pos = _LOG_FILE_HEADER.size
    pending = b""
    while pos + _LOG_CHUNK_HEADER.size <= len(data):
        left_in_block = _LOG_BLOCK - pos % _LOG_BLOCK
        if left_in_block < _LOG_CHUNK_HEADER.size:  # block trailer padding
            pos += left_in_block
            continue
        crc, length, kind = _LOG_CHUNK_HEADER.unpack_from(data, pos)
        payload = data[pos + _LOG_CHUNK_HEADER.size: pos + _LOG_CHUNK_HEADER.size + length]
        if kind == 0 or len(payload) < length:
            return
        # The checksum covers the type byte then the payload (plain zlib crc32 chained).
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            return
        pos += _LOG_CHUNK_HEADER.size + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload
            pending = b""


def wait_until_flushed(path: Path, timeout_s: float = 15.0) -> bool:
    """Wait until a .wandb file holds its run's exit record.

    run.finish() can return before wandb-core's writer has flushed the file (seen under pytest in 0.31); the next
    restart or a reader would then see a truncated segment. Bounded: False after timeout_s.
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            payloads = list(iter_record_payloads(path)) if Path(path).exists() else []
        except (struct.error, ValueError, OSError):
            payloads = []  # shorter than its header, or caught mid-write: not flushed yet
        for payload in payloads:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "exit":
                return True
        if time.monotonic() > deadline:
            log.warning("W&B file %s not flushed after %.0f s", path, timeout_s)
            return False
        time.sleep(0.05)


def _items_to_dict(items) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key = item.key or "/".join(item.nested_key)
        try:
            out[key] = json.loads(item.value_json)
        except json.JSONDecodeError:
            out[key] = item.value_json
    return out


@dataclass
class OfflineRun:
    """What the offline files of one run directory hold, all segments (restarts) together in start order."""

    run_id: str
    segments: list[Path]
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    group: str = ""
    project: str = ""
    alerts: list[dict[str, str]] = field(default_factory=list)


def offline_segments(run_dir: Path) -> list[Path]:
    """The .wandb files of this run directory's W&B run, oldest first (one per start/restart)."""
    run_dir = Path(run_dir)
    id_file = run_dir / RUN_ID_FILE
    if not id_file.exists():
        raise ValueError(f"{run_dir} has no {RUN_ID_FILE}: W&B was never started for this run directory")
    run_id = id_file.read_text().strip()
    if not (run_dir / "wandb").is_dir():
        return []
    found = []
    for d in (run_dir / "wandb").glob(f"*run-*-{run_id}"):
        f = d / f"run-{run_id}.wandb"
        if f.exists():
            # directory names are <offline-run|run>-<YYYYmmdd_HHMMSS>-<id>: sort by the timestamp
            found.append((d.name.split("-")[-2], f))
    return [f for _, f in sorted(found)]


def read_offline_run(run_dir: Path) -> OfflineRun:
    """Everything the local .wandb files of this run directory hold (offline runs; online runs keep them too)."""
    run_dir = Path(run_dir)
    segments = offline_segments(run_dir)
    return read_segments((run_dir / RUN_ID_FILE).read_text().strip(), segments)


def read_segments(run_id: str, segments: list[Path]) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2

    out = OfflineRun(run_id=run_id, segments=segments)
    for path in segments:
        for payload in iter_record_payloads(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                out.history.append(_items_to_dict(record.history.item))
            elif kind == "run":
                out.config.update(_items_to_dict(record.run.config.update))
                out.tags = list(record.run.tags)
                out.group = record.run.run_group
                out.project = record.run.project
            elif kind == "config":
                out.config.update(_items_to_dict(record.config.update))
            elif kind == "summary":
                out.summary.update(_items_to_dict(record.summary.update))
            elif kind == "alert":
                out.alerts.append({"title": record.alert.title, "text": record.alert.text})
    # wandb stores config values as {"value": v}; unwrap for readers
    out.config = {k: (v["value"] if isinstance(v, dict) and set(v) == {"value"} else v)
                  for k, v in out.config.items() if not k.startswith("_")}
    return out


def read_offline_history(run_dir: Path) -> list[dict[str, Any]]:
    """Every history row W&B wrote offline for this run directory, all restarts in order.

    Rows include W&B's own keys (_step, _runtime, _timestamp) and event-count / table rows; filter on the
    metric you want (e.g. rows with "loss").
    """
    return read_offline_run(run_dir).history
