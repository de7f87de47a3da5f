"""Checkpoints: DCP save/load in atomic directories with a manifest, checksums and retention.

One checkpoint is a directory `root/step_000123/`:

    dcp/.metadata, dcp/__R_I.distcp   tensors of the model and optimizer state (torch.distributed.checkpoint,
                                      reshardable to any world size)
    state_meta.pt                     the non-tensor leaves of those state dicts (optimizer param_groups, ...), rank 0
    scheduler.pt                      LR scheduler state_dict, rank 0 (absent when saved without a scheduler)
    extra_state.json                  the caller's JSON state: data position, policy, precision, elastic plan, ...
    rng/rank_00000.pt                 RNG states of each rank (torch CPU, CUDA, python, numpy)
    manifest.json                     written last: step, world_size, time, good, checksum algorithm,
                                      chunk_bytes, files {relative path: {size, digest}} (digest: the algorithm
                                      over the file's chunk digests, chunks hashed in parallel)

Life of a checkpoint:
1. `save` (collective): every rank writes into `root/.tmp-step_000123/`; the ranks hash the files (each rank a
   share), rank 0 writes manifest.json (good=false) and renames the directory to `root/step_000123`. A crash at
   any point leaves either the old state or a `.tmp-*` directory that readers ignore and rank 0 removes at start.
2. `mark_good` (rank 0 writes): after the monitors passed the steps after it, good=true is set by rewriting
   manifest.json through temp file + os.replace. Retention runs then (and after each save): the newest
   `keep_last` checkpoints and the newest `keep_good` good ones stay, everything older goes.
3. `latest` verifies candidates newest first (manifest readable, all files present with the recorded sizes and
   digests); a corrupt or partial one is reported with a `checkpoint_corrupt` event and skipped.
4. `load` reshards the tensors into the current model/optimizer (any world size, FSDP2 or plain), restores the
   scheduler, the RNG of this rank, and returns the extra state. Loading never deletes anything.

Trust: everything we write ourselves is read back with `torch.load(weights_only=True)` or json. Only tensors go
through DCP, so DCP's pickle path for non-tensor items (`torch.load(weights_only=False)` in its planner) is never
taken; DCP's own `.metadata` is a pickle that DCP reads, and its digest is checked against the manifest first.

RNG on load: with the same world size, each rank gets back exactly the states it saved. With a different world
size there is no meaningful mapping of old ranks to new ones, so every rank seeds torch (CPU and all CUDA
devices), python `random` and numpy from `derive_rng_seed(seed, step, rank)`: a pure function of the manager's
seed, the checkpoint step and the new rank, so a resumed run is reproducible for a given world size.

Events go to `event_sink(name, payload)`; each payload has `step`. `checkpoint_saved` (path, step, good=False),
`checkpoint_good` (path, step), `checkpoint_deleted` (path, step, reason) and `checkpoint_loaded` come from rank 0;
`checkpoint_corrupt` (path, step, reason) comes from the rank that found it (from rank 0 only when `latest` runs
collectively). Give non-zero ranks a sink that drops events if only rank 0 should write the event log.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from orchestration.checkpoint.host_memory import HostStaging, tensor_specs

try:  # numpy is optional for us; its RNG is saved only when it is importable
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch's usual environments
    np = None

FORMAT = "elastic-fp8-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
DCP_DIR = "dcp"
STATE_META = "state_meta.pt"
SCHEDULER = "scheduler.pt"
EXTRA_STATE = "extra_state.json"
RNG_DIR = "rng"
_STEP_RE = re.compile(r"^step_(\d+)$")

EventSink = Callable[[str, dict], None]

# DCP warns on every call that it runs single-process when no process group exists: intended here (world size 1).
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt or unreadable (not a user error in the arguments)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A verified, finalized checkpoint directory."""

    step: int
    path: Path
    world_size: int  # world size that wrote it (RNG states exist for ranks 0..world_size-1)
    good: bool
    time: float  # unix time the manifest was written
    manifest: dict = field(compare=False, repr=False)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rng_file_name(rank: int) -> str:
    return f"{RNG_DIR}/rank_{rank:05d}.pt"


def derive_rng_seed(seed: int, step: int, rank: int) -> int:
    """Seed for `rank` when resuming from `step` at a different world size (pure, stable across Python runs)."""
    digest = hashlib.sha256(f"elastic-fp8-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seed_all_rngs(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), python `random` and numpy from one integer."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds all CUDA devices
    if np is not None:
        np.random.seed(seed % 2**32)


def capture_rng_state() -> dict[str, Any]:
    """RNG states of this process in types that `torch.load(weights_only=True)` accepts."""
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate(), "numpy": None,
                             "cuda": None}
    if np is not None:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        # ndarrays are not allowed by weights_only loading; the MT19937 key fits an int64 tensor exactly
        state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one device per rank
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None and np is not None:
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def ray_checkpoint_dir(checkpoint: CheckpointInfo | str | Path) -> str:
    """Directory to give `ray.train.Checkpoint.from_directory` for a finalized checkpoint.

    Report it from rank 0 only (the directory holds every rank's files on a shared filesystem). Ray copies it
    into its storage at report time, so later `mark_good` calls do not reach Ray's copy: use this manager's
    root to find good checkpoints.
    """
    path = Path(checkpoint.path if isinstance(checkpoint, CheckpointInfo) else checkpoint).resolve()
    if path.name.startswith(TMP_PREFIX):
        raise ValueError(f"{path} is an unfinished temporary checkpoint directory; report the path save() returned")
    if not (path / MANIFEST).is_file():
        raise ValueError(f"{path} has no {MANIFEST}: not a finalized checkpoint (use the path save() returned)")
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# Small pure helpers: state-dict splitting, files, manifest checks


def split_tensors(tree: dict) -> tuple[dict, dict]:
    """Split a nested state dict into (tensor leaves, everything else), both keeping the dict nesting.

    Lists and tuples (e.g. optimizer param_groups) count as non-tensor leaves. Empty dicts are dropped from the
    tensor side (DCP has nothing to write for them).
    """
    tensors: dict = {}
    rest: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub_tensors, sub_rest = split_tensors(value)
            if sub_tensors:
                tensors[key] = sub_tensors
            rest[key] = sub_rest
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            rest[key] = value
    return tensors, rest


def _deleted_events(deleted: list[tuple[int, Path]], reason: str = "retention") -> list[tuple[str, dict]]:
    return [("checkpoint_deleted", {"step": step, "path": str(path), "reason": reason}) for step, path in deleted]


def _leaves(tree: dict) -> list:
    """The non-dict leaves of a nested dict."""
    out = []
    for value in tree.values():
        out.extend(_leaves(value) if isinstance(value, dict) else [value])
    return out


def merge_trees(base: dict, overlay: dict) -> dict:
    """Deep merge: keys of `overlay` win; nested dicts merge."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = value
    return out


# Digests of checkpoint files are computed over 64 MiB chunks in parallel threads (hashlib releases the GIL on large
# buffers): one thread hashed a 23 GB checkpoint in tens of seconds on the H200 host (BENCHMARKS.md, session 12).
DIGEST_CHUNK_BYTES = 64 << 20
_READ_BYTES = 8 << 20


def io_threads() -> int:
    """Threads for one rank's checkpoint writes and hashing: at most 8, within the CPUs this process may use
    (affinity: Ray's cpus_per_worker, taskset) shared by the ranks of its node (LOCAL_WORLD_SIZE)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, min(8, cpus // local_ranks))


class ParallelFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with its files read in threads, one group of requests per file (DCP's reads them one file
    after the other: 13 GB took 9-11 s on the H200 host, ~1.2 GB/s, most of a resume's downtime - BENCHMARKS.md
    session 14). Each file's requests go through the parent's own read_data, so the format handling stays DCP's;
    the files' requests write disjoint destinations. Safe with DefaultLoadPlanner (resolve_tensor only looks up and
    narrows, commit_tensor does nothing, load_bytes assigns into existing containers); a custom planner that keeps
    state in those calls would need its own locking."""

    def __init__(self, path: str | os.PathLike, threads: int):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if self.threads <= 1 or len(per_file) <= 1:
            return super().read_data(plan, planner)
        read_one = super().read_data
        with ThreadPoolExecutor(min(self.threads, len(per_file)), thread_name_prefix="checkpoint-read") as pool:
            futures = [pool.submit(read_one, replace(plan, items=items), planner)
                       for items in per_file.values()]
            for f in futures:
                f.result().wait()  # raises the first failure, after the pool has finished the others
        return futures[0].result()


def _chunk_digest(path: Path, offset: int, length: int, algorithm: str) -> bytes:
    h = hashlib.new(algorithm)
    buf = bytearray(min(_READ_BYTES, max(length, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        remaining = length
        while remaining > 0:
            n = f.readinto(view[:min(remaining, len(buf))])
            if not n:
                raise OSError(f"{path} ended {remaining} bytes before its recorded size")
            h.update(view[:n])
            remaining -= n
    return h.digest()


def file_digests(paths: list[Path], algorithm: str, chunk_bytes: int | None, threads: int = 1) -> list[str]:
    """The digest of each file. chunk_bytes=None: `algorithm` over the whole file (manifests written before
    session 12). Otherwise: `algorithm` over the concatenated digests of the file's chunk_bytes-long chunks (one
    chunk for an empty file), the chunks of all files hashed by `threads` threads."""
    if chunk_bytes is None:
        out = []
        for path in paths:
            with open(path, "rb") as f:
                out.append(hashlib.file_digest(f, algorithm).hexdigest())
        return out
    jobs: list[tuple[int, Path, int, int]] = []
    for index, path in enumerate(paths):
        size = path.stat().st_size
        jobs += [(index, path, offset, min(chunk_bytes, size - offset))
                 for offset in range(0, max(size, 1), chunk_bytes)]
    if threads > 1 and len(jobs) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=threads) as pool:
            chunk_digests = list(pool.map(lambda job: _chunk_digest(job[1], job[2], job[3], algorithm), jobs))
    else:
        chunk_digests = [_chunk_digest(path, offset, length, algorithm) for _, path, offset, length in jobs]
    combined = [hashlib.new(algorithm) for _ in paths]
    for (index, *_), digest in zip(jobs, chunk_digests, strict=True):
        combined[index].update(digest)
    return [h.hexdigest() for h in combined]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so readers see the old or the new file, never a half-written one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _check_weights_only_roundtrip(obj: Any, what: str) -> bytes:
    """Serialize `obj` and prove it loads with weights_only=True, so a bad type fails at save, not at resume."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # the unpickler raises UnpicklingError or others depending on the type
        raise ValueError(f"{what} holds a type that torch.load(weights_only=True) refuses, so it could not be "
                         f"resumed: {e}. Keep it to tensors, numbers, strings, lists, tuples and dicts.") from e
    return data


def _list_files(directory: Path) -> list[str]:
    """Relative POSIX paths of all regular files under `directory`, sorted (the manifest is excluded)."""
    out = []
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def read_manifest(path: Path) -> dict:
    """Parse and sanity-check `path/manifest.json`; CheckpointError with the reason otherwise."""
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{MANIFEST} missing (partial or foreign checkpoint)")
    try:
        manifest = json.loads(mpath.read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"unreadable {MANIFEST}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{MANIFEST} is not an {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{MANIFEST} has version {manifest.get('version')!r}; this code reads {FORMAT_VERSION}")
    for key, kind in (("step", int), ("world_size", int), ("files", dict), ("checksum", str), ("good", bool)):
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{MANIFEST} field {key!r} missing or not {kind.__name__}")
    if manifest["world_size"] < 1:
        raise CheckpointError(f"{MANIFEST} has world_size {manifest['world_size']}")
    return manifest


def verify_checkpoint(path: str | Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> CheckpointInfo:
    """Verify one checkpoint directory and describe it; CheckpointError(reason) when it is partial or corrupt.

    Sizes of all files are checked; digests only of this caller's share (file index % share[1] == share[0]),
    so a collective verification spreads the hashing over the ranks.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError("not a directory")
    manifest = read_manifest(path)
    files: dict = manifest["files"]
    algorithm = manifest["checksum"]
    if checksums and algorithm not in hashlib.algorithms_available:
        raise CheckpointError(f"checksum algorithm {algorithm!r} not available in this Python")
    required = {f"{DCP_DIR}/.metadata", STATE_META, EXTRA_STATE}
    required |= {rng_file_name(r) for r in range(manifest["world_size"])}
    unlisted = sorted(required - files.keys())
    if unlisted:
        raise CheckpointError(f"{MANIFEST} does not list required files {unlisted}")
    chunk_bytes = manifest.get("chunk_bytes")  # absent: whole-file digests (manifests before session 12)
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool)
                                    or chunk_bytes < 1):
        raise CheckpointError(f"{MANIFEST} field 'chunk_bytes' is {chunk_bytes!r}, not a positive int")
    share_rank, share_size = share
    to_hash: list[tuple[str, Path]] = []
    for index, rel in enumerate(sorted(files)):
        meta = files[rel]
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"{MANIFEST} lists a path outside the checkpoint: {rel!r}")
        file_path = path / rel
        if not isinstance(meta, dict):
            raise CheckpointError(f"{MANIFEST} entry for {rel!r} is not a dict")
        if not file_path.is_file():
            raise CheckpointError(f"file missing: {rel}")
        try:  # an unreadable file (permissions, I/O error, stale NFS handle) is a bad checkpoint, not a crash
            size = file_path.stat().st_size
        except OSError as e:
            raise CheckpointError(f"cannot stat {rel}: {e}") from e
        if size != meta.get("size"):
            raise CheckpointError(f"size mismatch in {rel}: manifest {meta.get('size')}, on disk {size}")
        if checksums and index % share_size == share_rank:
            to_hash.append((rel, file_path))
    # Sizes and presence of every file first (cheap), then the digests of this caller's share, in parallel.
    try:
        digests = file_digests([p for _, p in to_hash], algorithm, chunk_bytes, io_threads())
    except OSError as e:
        raise CheckpointError(f"cannot read a file of the checkpoint: {e}") from e
    for (rel, _), digest in zip(to_hash, digests, strict=True):
        if digest != files[rel].get("digest"):
            raise CheckpointError(f"{algorithm} mismatch in {rel}: manifest {files[rel].get('digest')}, "
                                  f"on disk {digest}")
    return CheckpointInfo(step=manifest["step"], path=path, world_size=manifest["world_size"],
                          good=manifest["good"], time=float(manifest.get("time", 0.0)), manifest=manifest)


# ---------------------------------------------------------------------------------------------------------------
# Collectives (no-ops without an initialized process group)


def _dcp_failure_summary(exc: CheckpointException) -> str:
    """The causes of a DCP load failure, one per distinct message (e.g. 'Size mismatch ... for model.w'), without
    the per-rank tracebacks DCP's own message carries."""
    causes = []
    for failure in getattr(exc, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        text = f"{type(cause).__name__}: {cause}"
        if text not in causes:
            causes.append(text)
    return "; ".join(causes[:5]) or str(exc).splitlines()[0]


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_size(group: Any = None) -> int:
    return dist.get_world_size(group) if _dist_on() else 1


def _sync_errors(error: str | None, what: str, group: Any = None) -> None:
    """All ranks learn whether any rank failed, and all raise together (no rank is left waiting)."""
    if _group_size(group) > 1:
        errors: list = [None] * _group_size(group)
        dist.all_gather_object(errors, error, group=group)
    else:
        errors = [error]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed: {detail}")


def _broadcast_from_rank0(obj: Any, group: Any = None) -> Any:
    if _group_size(group) > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return obj


def _gather_to_all(obj: Any, group: Any = None) -> list:
    if _group_size(group) > 1:
        out: list = [None] * _group_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return [obj]


def stage_to_host(tree: dict, staging: HostStaging, prefix: str = "") -> dict:
    """A copy of a nested dict of tensors in host memory, for a background save: each tensor (a DTensor's local
    shard, keeping its sharding spec) is copied into a CPU buffer of `staging` (kept from one save to the next),
    page-locked when the source is on a GPU so the copy is a DMA at full speed and non-blocking.

    The copies are queued on the current stream; the caller must synchronize (an event) before reading them on the
    host, and later kernels on that stream (the optimizer step) cannot overwrite the sources before they are done."""
    from torch.distributed.tensor import DTensor

    if not prefix:  # every missing buffer at once: the page-locked ones in one arena, one registration
        staging.ensure(tensor_specs(tree))
    out: dict = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}"
        if isinstance(value, dict):
            out[key] = stage_to_host(value, staging, path)
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        buf = staging.buffer(path, local)
        buf.copy_(local.detach(), non_blocking=local.is_cuda)
        # DTensor with a host-memory local shard and the source's spec (mesh, placements, global shape): DCP writes
        # it as the same shard of the same global tensor.
        out[key] = DTensor(buf, value._spec, requires_grad=False) if isinstance(value, DTensor) else buf
    return out


@dataclass
class _SaveJob:
    """One save between staging and the finalized directory (see CheckpointManager.save)."""

    step: int
    tmp: Path
    final: Path
    tensors: dict
    rng_bytes: bytes
    rest_bytes: bytes
    sched_bytes: bytes | None
    extra_json: str
    group: Any  # process group of this save's collectives (None: the default group)
    ready: Any = None  # CUDA event after the host copies (background saves), None when nothing to wait for
    device: Any = None  # the CUDA device of the copies: a new thread starts on device 0
    timing: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # (name, payload), emitted on the caller's thread
    error: BaseException | None = None
    thread: Any = None


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------------------------


class CheckpointManager:
    """Atomic, verified, reshardable checkpoints under one root directory (see the module docstring).

    `save` and `latest(collective=True)` are collectives: call them on every rank. `mark_good` and
    `discard_newer_than` write on rank 0 only and return at once elsewhere; `latest()` (default) and `load` are
    local reads (`load` runs DCP collectives when a process group is initialized, so call it on every rank).
    """

    def __init__(self, root: str | Path, keep_last: int = 3, keep_good: int = 2, *, rank: int | None = None,
                 world_size: int | None = None, event_sink: EventSink | None = None, seed: int = 0,
                 checksum: str = "sha256", create: bool = True, clean_tmp: bool = True) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1 (checkpoints to keep), got {keep_last!r}")
        if not isinstance(keep_good, int) or keep_good < 1:
            raise ValueError(f"keep_good must be an int >= 1 (the newest good checkpoint is always kept), "
                             f"got {keep_good!r}")
        if checksum not in hashlib.algorithms_available:
            raise ValueError(f"checksum {checksum!r} is not a hashlib algorithm here; use e.g. 'sha256' or "
                             f"'blake2b' (faster on CPUs without SHA instructions)")
        dist_rank = dist.get_rank() if _dist_on() else 0
        dist_world = dist.get_world_size() if _dist_on() else 1
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")
        if _dist_on() and (self.rank, self.world_size) != (dist_rank, dist_world):
            raise ValueError(f"rank/world_size {self.rank}/{self.world_size} disagree with the initialized "
                             f"process group ({dist_rank}/{dist_world}); leave them out to use the group's")
        self.keep_last = keep_last
        self.keep_good = keep_good
        # Steps whose good/bad verdict is still pending (the worker waits monitor.good_after_steps clean steps):
        # retention keeps them, or a short every_steps would delete a checkpoint before it could be marked good.
        self.awaiting_good: set[int] = set()
        self.seed = seed
        self.checksum = checksum
        self.event_sink = event_sink
        self.last_load_rng: str | None = None  # "restored" or "derived" after load()
        self.last_save_timing: dict[str, float] = {}  # this rank's share of the last save (see save)
        self._pending: _SaveJob | None = None  # the background save in flight
        self._unreported: _SaveJob | None = None  # finished background save not yet returned by wait()
        # host buffers of staged saves (orchestration.checkpoint.host_memory), their pages touched by this rank's I/O threads
        self._staging = HostStaging(touch_threads=io_threads())
        self._io_group_handle: Any = None
        self._io_group_for: Any = None
        self.root = Path(root).expanduser().absolute()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"checkpoint root {self.root} exists but is not a directory")
        if not self.root.exists():
            if not create:
                raise ValueError(f"checkpoint root {self.root} does not exist; create it or pass create=True")
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cannot create checkpoint root {self.root}: {e}") from e
        if clean_tmp and self.rank == 0:
            # leftovers of saves or deletions that crashed; nobody else writes here before our first save
            for leftover in self._tmp_dirs():
                shutil.rmtree(leftover, ignore_errors=True)

    # -- events ---------------------------------------------------------------------------------------------------

    def _emit(self, name: str, payload: dict) -> None:
        if self.event_sink is not None:
            self.event_sink(name, payload)

    # -- listing ----------------------------------------------------------------------------------------------------

    def _require_root(self) -> None:
        if not self.root.is_dir():
            raise CheckpointError(f"checkpoint root {self.root} does not exist (deleted, or the storage is not "
                                  f"mounted on this node?)")

    def _tmp_dirs(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir()]

    def finalized(self) -> list[tuple[int, Path]]:
        """(step, path) of every `step_*` directory, newest first; not verified."""
        self._require_root()
        out = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
        return sorted(out, key=lambda sp: sp[0], reverse=True)

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    # -- save -------------------------------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             scheduler: Any | None = None, extra_state: dict | None = None, *, background: bool = False,
             stage: bool | None = None) -> Path:
        """Collective: write checkpoint `step` atomically and return its final directory (on every rank).

        background=True: copy the tensors to host memory (pinned buffers kept between saves), then write, hash and
        finalize in a thread while training goes on; the directory appears when that finishes. The write's
        collectives run on a separate gloo group (the training thread owns the default one). Any later call on
        this manager (a save, latest, load, mark_good of that step, ...) first waits for it; `wait()` does so
        explicitly and raises its error, if any. Until then a crash loses only this save (its .tmp- directory).

        stage (default: background): copy GPU tensors into the pinned host buffers before writing, also for a
        synchronous save. Why: DCP's own device-to-host copies go to pageable memory and made up most of a save on
        the H200 (13 GB: write 9.3-9.9 s through DCP from the GPU, 1.2-1.7 s from the pinned copy, session 13).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        extra_state = {} if extra_state is None else extra_state
        if not isinstance(extra_state, dict):
            raise TypeError(f"extra_state must be a dict, got {type(extra_state).__name__}")
        try:
            extra_json = json.dumps(extra_state, indent=1, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra_state must be JSON-serialisable (convert tensors with .item()/.tolist()): "
                             f"{e}") from e
        if not _dist_on() and self.world_size != 1:
            raise ValueError(f"save with world_size {self.world_size} needs an initialized process group (every "
                             f"rank writes its shard); initialize torch.distributed or use world_size=1")
        self._join()  # one save at a time: the staging buffers are reused
        self._require_root()

        # Everything that can fail on bad input runs before the first collective, identically on every rank.
        t_start = time.perf_counter()
        state = self._get_state(model, optimizer)
        tensors, rest = split_tensors(state)
        rest_bytes = _check_weights_only_roundtrip(rest, "the non-tensor part of the model/optimizer state")
        sched_bytes = None
        if scheduler is not None:
            sched_bytes = _check_weights_only_roundtrip(scheduler.state_dict(), "the LR scheduler state_dict")
        rng_bytes = _check_weights_only_roundtrip(capture_rng_state(), "the RNG state")

        name = step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{name}"
        error = None
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / RNG_DIR).mkdir(parents=True)
            except OSError as e:
                error = _err(e)
        _sync_errors(error, f"creating {tmp}")
        job = _SaveJob(step=step, tmp=tmp, final=self.root / name, tensors=tensors, rng_bytes=rng_bytes,
                       rest_bytes=rest_bytes, sched_bytes=sched_bytes, extra_json=extra_json, group=None)
        t_stage = time.perf_counter()
        job.timing["state_s"] = round(t_stage - t_start, 3)
        if background if stage is None else stage:
            error = None
            cuda = [t.device for t in _leaves(tensors) if t.is_cuda]
            try:  # pinning tens of GB of host memory can fail on one rank: all ranks must learn it before writing
                job.tensors = stage_to_host(tensors, self._staging)
                if cuda:
                    job.device = cuda[0]
                    job.ready = torch.cuda.Event()
                    job.ready.record()
            except (RuntimeError, OSError) as e:
                error = _err(e)
                # Copies queued before the failure may still be landing in the buffers: let them finish before the
                # buffers are unregistered and freed.
                if cuda:
                    try:
                        torch.cuda.synchronize()
                    except RuntimeError:
                        pass  # a broken device: its copies are not running either
                self._staging.release()
            _sync_errors(error, f"copying the state of step {step} to host memory")
            job.timing["stage_s"] = round(time.perf_counter() - t_stage, 3)
            if self._staging.last_alloc:  # buffers allocated by this save (its first, or after a reshape)
                job.timing["stage_alloc_s"] = self._staging.last_alloc["alloc_s"]
                job.timing["stage_new_buffers"] = self._staging.last_alloc["new_buffers"]
                job.timing["stage_pinned_fallbacks"] = self._staging.fallbacks
        if not background:
            if job.ready is not None:
                job.ready.synchronize()
            self._write_and_finalize(job)
            job.tensors = {}
            self._finish(job)
            return job.final
        job.group = self._io_group()
        job.thread = threading.Thread(target=self._background_save, args=(job,), name=f"checkpoint-{step}", daemon=True)
        self._pending = job
        job.thread.start()
        return job.final

    def prepare_staging(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Allocate the host buffers of staged saves for this state's tensors in a background thread (page-locked
        for GPU tensors), so that the next save finds them ready; that save waits if they are not. Local (no
        collective). Returns the number of buffers being prepared. For a resumed run, whose first save would
        otherwise allocate them while training waits (1 s for 13 GiB by registration, 5-8 s by cudaHostAlloc)."""
        self._join()
        specs = tensor_specs(self._get_state(model, optimizer))
        self._staging.prepare(specs)
        return len(specs)

    def _io_group(self) -> Any:
        """A gloo group over all ranks for background saves (None without a process group). Created collectively on
        the first background save, again if the default group was replaced (an in-process re-init)."""
        if not _dist_on() or dist.get_world_size() == 1:
            return None
        default = dist.group.WORLD
        if self._io_group_for is not default:
            try:
                self._io_group_handle = dist.new_group(backend="gloo")
            except (RuntimeError, ValueError) as e:
                raise CheckpointError(f"background saves need a gloo group beside the training one and creating it "
                                      f"failed ({_err(e)}): set GLOO_SOCKET_IFNAME to the nodes' network interface, "
                                      "or checkpoint.async_save=never") from e
            self._io_group_for = default
        return self._io_group_handle

    def _background_save(self, job: _SaveJob) -> None:
        t0 = time.perf_counter()
        try:
            if job.device is not None:
                torch.cuda.set_device(job.device)  # the event's and DCP's stream calls act on the current device
            if job.ready is not None:
                job.ready.synchronize()  # the host copies have landed
            job.timing["copy_wait_s"] = round(time.perf_counter() - t0, 3)
            self._write_and_finalize(job)
            job.timing["background_s"] = round(time.perf_counter() - t0, 3)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread by _join
            job.error = e

    def _write_and_finalize(self, job: _SaveJob) -> None:
        """DCP write, small files, parallel hashing, manifest and rename (rank 0), retention. Collective over
        job.group. Events go to job.events (emitted by _finish on the caller's thread)."""
        tmp, final, step, group = job.tmp, job.final, job.step, job.group
        t_write = time.perf_counter()
        # Several writer threads (each rank then writes that many files): one thread wrote ~0.5 GB/s from the H200 to
        # tmpfs (session 12). DCP's single-process warning is filtered at import (warnings.catch_warnings is not
        # thread-safe, and this runs in the save thread).
        dcp.save(job.tensors, storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR, thread_count=io_threads()),
                 process_group=group)
        error = None
        try:
            (tmp / rng_file_name(self.rank)).write_bytes(job.rng_bytes)
            if self.rank == 0:
                (tmp / STATE_META).write_bytes(job.rest_bytes)
                if job.sched_bytes is not None:
                    (tmp / SCHEDULER).write_bytes(job.sched_bytes)
                (tmp / EXTRA_STATE).write_text(job.extra_json, encoding="ascii")
        except OSError as e:
            error = _err(e)
        _sync_errors(error, f"writing {tmp}", group)

        # Hash in parallel: rank 0's listing is the truth (directory caches may lag on network filesystems).
        t_hash = time.perf_counter()
        files = _broadcast_from_rank0(_list_files(tmp) if self.rank == 0 else None, group)
        error, digests = None, {}
        try:
            mine = [rel for index, rel in enumerate(files) if index % self.world_size == self.rank]
            hashed = file_digests([tmp / rel for rel in mine], self.checksum, DIGEST_CHUNK_BYTES, io_threads())
            for rel, digest in zip(mine, hashed, strict=True):
                digests[rel] = {"size": (tmp / rel).stat().st_size, "digest": digest}
        except OSError as e:
            error = _err(e)
        gathered = _gather_to_all((error, digests), group)
        _sync_errors(error, f"hashing {tmp}", group)

        error, deleted = None, []
        t_finalize = time.perf_counter()
        if self.rank == 0:
            try:
                all_digests: dict = {}
                for _, part in gathered:
                    all_digests.update(part)
                assert sorted(all_digests) == files, "every listed file is hashed exactly once"
                manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step,
                            "world_size": self.world_size, "time": time.time(), "good": False,
                            "checksum": self.checksum, "chunk_bytes": DIGEST_CHUNK_BYTES, "files": all_digests,
                            "torch_version": torch.__version__,
                            "has_scheduler": job.sched_bytes is not None}
                write_json_atomic(tmp / MANIFEST, manifest)
                _fsync_dir(tmp)
                replaced = None
                if final.exists():
                    # Re-saving a step (after a rollback): the new one wins; the old one goes via a .tmp name so
                    # a crash here never leaves a half-deleted step_ directory.
                    replaced = self.root / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}"
                    os.rename(final, replaced)
                os.rename(tmp, final)
                _fsync_dir(self.root)
                if replaced is not None:
                    shutil.rmtree(replaced, ignore_errors=True)
                deleted = self._apply_retention()
            except OSError as e:
                error = _err(e)
        _sync_errors(error, f"finalizing {final}", group)
        t_end = time.perf_counter()
        # Where this rank's save time went (the worker puts it in its checkpoint_timing event): state dicts, the
        # host copies of a background save, the DCP write (device-to-host copies and files), hashing, and the
        # manifest, renames and retention.
        job.timing.update(write_s=round(t_hash - t_write, 3), hash_s=round(t_finalize - t_hash, 3),
                          finalize_s=round(t_end - t_finalize, 3),
                          hashed_bytes=sum(meta["size"] for meta in digests.values()))
        if self.rank == 0:
            job.events.append(("checkpoint_saved", {"step": step, "path": str(final), "good": False}))
            job.events.extend(_deleted_events(deleted))

    def _finish(self, job: _SaveJob) -> None:
        self.last_save_timing = dict(job.timing)
        for name, payload in job.events:
            self._emit(name, payload)

    def _join(self) -> None:
        """Wait for the background save in flight, if any; emit its events; raise its error (once)."""
        job, self._pending = self._pending, None
        if job is None:
            return
        job.thread.join()
        job.tensors = {}  # the staged views; the buffers stay for the next save
        if job.error is not None:
            self._unreported = None
            if isinstance(job.error, CheckpointError):
                raise CheckpointError(f"background save of step {job.step}: {job.error}") from job.error
            raise CheckpointError(f"background save of step {job.step} failed: {_err(job.error)}") from job.error
        self._finish(job)
        self._unreported = job

    def wait(self) -> tuple[int, Path, dict] | None:
        """Finish the background save in flight (CheckpointError if it failed). Returns (step, path, timing) of the
        newest background save that finished and was not returned by an earlier wait(), else None."""
        self._join()
        job, self._unreported = self._unreported, None
        return None if job is None else (job.step, job.final, dict(job.timing))

    def abandon(self, timeout_s: float) -> tuple[int, bool] | None:
        """After the training thread failed: wait up to timeout_s for the save in flight, without raising its error.
        Returns (step, finalized) for a save that was in flight or unjoined, else None."""
        job = self._pending
        if job is None:
            return None
        job.thread.join(timeout_s)
        if job.thread.is_alive():
            return job.step, False
        self._pending = None
        return job.step, job.error is None

    def save_in_flight(self, step: int | None = None) -> bool:
        """Whether a background save (of `step`, if given) is still writing. Local, non-blocking."""
        job = self._pending
        return job is not None and job.thread.is_alive() and (step is None or job.step == step)

    def _get_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    # -- good marks and retention ---------------------------------------------------------------------------------

    def mark_good(self, step: int) -> None:
        """Mark checkpoint `step` good (rank 0 writes; other ranks return) and apply retention."""
        if self.rank != 0:
            return
        # No wait for a save in flight (only rank 0 gets here: waiting would stall it alone, and raising that save's
        # error on rank 0 alone would leave the other ranks in their next collective). The worker does not mark a
        # step whose own save is in flight; retention waits for the save thread, which runs it again at its end.
        path = self.path_for(step)
        if not path.is_dir():
            raise CheckpointError(f"cannot mark step {step} good: {path} does not exist")
        try:
            manifest = read_manifest(path)
        except CheckpointError as e:
            raise CheckpointError(f"cannot mark step {step} good: {path}: {e}") from e
        self.awaiting_good.discard(step)
        if not manifest["good"]:
            manifest["good"] = True
            manifest["good_time"] = time.time()
            write_json_atomic(path / MANIFEST, manifest)
        self._emit("checkpoint_good", {"step": step, "path": str(path)})
        if not self.save_in_flight():
            self._emit_deleted(self._apply_retention())

    def unjudged_steps(self, up_to: int) -> list[int]:
        """Finalized checkpoints at or before `up_to` newer than the newest good one and not good themselves: the
        ones whose verdict a stopped run left pending (a resumed run goes on waiting for them)."""
        self._join()
        entries = [(s, p) for s, p in self.finalized() if s <= up_to]
        newest_good = max((s for s, p in entries if self._is_good(p)), default=-1)
        return sorted(s for s, p in entries if s > newest_good)

    def _is_good(self, path: Path) -> bool:
        try:
            return read_manifest(path)["good"]
        except CheckpointError:
            return False

    def retention_plan(self) -> tuple[list[int], list[int]]:
        """(steps kept, steps to delete) under keep_last / keep_good; pure apart from reading manifests."""
        entries = self.finalized()
        steps = [s for s, _ in entries]
        good_steps = [s for s, p in entries if self._is_good(p)]
        keep = set(steps[: self.keep_last]) | set(good_steps[: self.keep_good]) | (set(steps) & self.awaiting_good)
        return sorted(keep), sorted(s for s in steps if s not in keep)

    def _apply_retention(self) -> list[tuple[int, Path]]:
        _, delete = self.retention_plan()
        deleted = []
        for step in delete:
            path = self.path_for(step)
            self._remove_dir(path, step)
            deleted.append((step, path))
        return deleted

    def _remove_dir(self, path: Path, step: int) -> None:
        # rename first: readers never see a half-deleted step_ directory
        trash = self.root / f"{TMP_PREFIX}deleted-{path.name}-{os.getpid()}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _emit_deleted(self, deleted: list[tuple[int, Path]], reason: str = "retention") -> None:
        for name, payload in _deleted_events(deleted, reason):
            self._emit(name, payload)

    def discard_newer_than(self, step: int) -> list[Path]:
        """After a rollback to `step`: delete the checkpoints of the abandoned trajectory (rank 0 only).

        Without this a restart would resume from a newer checkpoint of the diverged run. Returns deleted paths.
        """
        self._join()
        if self.rank != 0:
            return []
        deleted = []
        for s, path in self.finalized():
            if s > step:
                self._remove_dir(path, s)
                deleted.append((s, path))
        self._emit_deleted(deleted, reason=f"rollback to step {step}")
        return [p for _, p in deleted]

    # -- find and verify --------------------------------------------------------------------------------------------

    def verify(self, path: str | Path, *, checksums: bool = True) -> CheckpointInfo:
        """Verify one directory (any location, e.g. a Ray-restored checkpoint); CheckpointError if bad."""
        path = Path(path)
        try:
            return verify_checkpoint(path, checksums=checksums)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from e

    def latest(self, good_only: bool = False, *, collective: bool = False,
               checksums: bool = True) -> CheckpointInfo | None:
        """Newest checkpoint that verifies (and is good, with good_only); None if there is none.

        Corrupt or partial ones are skipped with a `checkpoint_corrupt` event. With collective=True (call on all
        ranks) rank 0's listing is used, each rank hashes a share of the files, and all ranks get the same answer.
        """
        self._join()
        use_group = collective and _dist_on() and dist.get_world_size() > 1
        share = (self.rank, self.world_size) if use_group else (0, 1)
        if use_group:
            listing = None
            if self.rank == 0:
                listing = [(s, str(p), self._is_good(p)) for s, p in self.finalized()]
            listing = _broadcast_from_rank0(listing)
        else:
            listing = [(s, str(p), self._is_good(p)) for s, p in self.finalized()]
        for step, path_str, good in listing:
            path = Path(path_str)
            if good_only and not good:
                # skipped without hashing; an unreadable manifest reads as not good and is reported when
                # a non-good_only call reaches it
                continue
            reason, info = None, None
            try:
                info = verify_checkpoint(path, checksums=checksums, share=share)
                if info.step != step:
                    raise CheckpointError(f"manifest says step {info.step} but the directory is {path.name}")
            except CheckpointError as e:
                reason = str(e)
            if use_group:
                reasons = [r for r in _gather_to_all(reason)]
                bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
                reason = "; ".join(f"rank {r}: {why}" for r, why in bad) if bad else None
            if reason is not None and not use_group and not path.exists():
                continue  # deleted by rank 0's retention since we listed it: gone, not corrupt
            if reason is not None:
                if not use_group or self.rank == 0:
                    self._emit("checkpoint_corrupt", {"step": step, "path": str(path), "reason": reason})
                continue
            assert info is not None
            return info
        return None

    # -- load -------------------------------------------------------------------------------------------------------

    def load(self, info: CheckpointInfo | str | Path, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer | None = None, scheduler: Any | None = None) -> dict:
        """Load `info` into the (possibly resharded) model/optimizer/scheduler; return the extra state.

        Call on every rank when a process group is initialized (DCP reads collectively). Call it before the
        first backward or right after an optimizer step (get/set_state_dict need initialized optimizer state).
        """
        self._join()
        if not isinstance(info, CheckpointInfo):
            info = self.verify(info)
        path = info.path
        if scheduler is not None and not (path / SCHEDULER).is_file():
            raise CheckpointError(f"checkpoint {path} was saved without a scheduler; pass scheduler=None or "
                                  f"resume from a checkpoint that has one")
        try:
            saved_rest = torch.load(path / STATE_META, weights_only=True, map_location="cpu")
            extra_state = json.loads((path / EXTRA_STATE).read_text(encoding="ascii"))
        except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
            raise CheckpointError(f"checkpoint {path}: cannot read {STATE_META}/{EXTRA_STATE}: {e}") from e
        if optimizer is not None and "optim" not in saved_rest:
            raise CheckpointError(f"checkpoint {path} has no optimizer state; pass optimizer=None to load "
                                  f"the model only")
        dest = self._get_state(model, optimizer)
        tensors, _ = split_tensors(dest)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            try:
                # in place, resharded to the current layout; the rank's files read in threads
                dcp.load(tensors, storage_reader=ParallelFileSystemReader(path / DCP_DIR, io_threads()))
            except CheckpointException as e:  # a BaseException: would escape `except Exception` handlers
                raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: "
                                      f"{_dcp_failure_summary(e)}; a run resumes with the model settings it was "
                                      "saved with (model.name, model.overrides), or choose a new run_name") from None
        merged = merge_trees(saved_rest, tensors)
        if optimizer is None:
            set_model_state_dict(model, merged["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=merged["model"], optim_state_dict=merged["optim"])
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=True, map_location="cpu"))
        if info.world_size == self.world_size:
            restore_rng_state(torch.load(path / rng_file_name(self.rank), weights_only=True, map_location="cpu"))
            rng = "restored"
        else:
            seed_all_rngs(derive_rng_seed(self.seed, info.step, self.rank))
            rng = "derived"
        if self.rank == 0:
            self._emit("checkpoint_loaded", {"step": info.step, "path": str(path), "from_world_size":
                                             info.world_size, "world_size": self.world_size, "rng": rng})
        self.last_load_rng = rng
        return extra_state
