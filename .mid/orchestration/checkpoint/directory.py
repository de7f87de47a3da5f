"""One checkpoint directory on disk: its layout, manifest, checksums and verification.

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

Trust: everything we write ourselves is read back with `torch.load(weights_only=True)` or json. Only tensors go
through DCP, so DCP's pickle path for non-tensor items (`torch.load(weights_only=False)` in its planner) is never
taken; DCP's own `.metadata` is a pickle that DCP reads, and its digest is checked against the manifest first.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT = "elastic-fp8-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = f"{TMP_PREFIX}replaced-"  # a step_ directory being replaced by a new save of its step
DCP_DIR = "dcp"
STATE_META = "state_meta.pt"
SCHEDULER = "scheduler.pt"
EXTRA_STATE = "extra_state.json"
RNG_DIR = "rng"
STEP_DIR_RE = re.compile(r"^step_(\d+)$")


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


# Digests of checkpoint files are computed over 64 MiB chunks in parallel threads (hashlib releases the GIL on large
# buffers): one thread takes tens of seconds for a checkpoint of tens of GB.
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


def file_digests(paths: list[Path], algorithm: str, chunk_bytes: int, threads: int = 1) -> list[str]:
    """The digest of each file: `algorithm` over the concatenated digests of the file's chunk_bytes-long chunks
    (one chunk for an empty file), the chunks of all files hashed by `threads` threads."""
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


def fsync_dir(path: Path) -> None:
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


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
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
    fsync_dir(path.parent)


def weights_only_bytes(obj: Any, what: str) -> bytes:
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


def list_files(directory: Path) -> list[str]:
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
    try:  # is_file() raises, not returns False, where the directory may not be searched (permissions)
        present = mpath.is_file()
    except OSError as e:
        raise CheckpointError(f"unreadable {MANIFEST}: {e}") from e
    if not present:
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
    chunk_bytes = manifest.get("chunk_bytes")
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
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
        try:  # an unreadable file (permissions, I/O error, stale NFS handle) is a bad checkpoint, not a crash
            if not file_path.is_file():
                raise CheckpointError(f"file missing: {rel}")
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
