"""Writing one save: the DCP tensors, the small files, parallel hashing, the manifest and the atomic rename.
Runs on the training thread (synchronous saves) or in the save thread (background saves)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from orchestration.checkpoint.collectives import broadcast_from_rank0, gather_to_all, sync_errors
from orchestration.checkpoint.directory import (
    DCP_DIR,
    DIGEST_CHUNK_BYTES,
    EXTRA_STATE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    REPLACED_PREFIX,
    SCHEDULER,
    STATE_META,
    file_digests,
    fsync_dir,
    fsync_file,
    io_threads,
    list_files,
    rng_file_name,
    write_json_atomic,
)
from orchestration.checkpoint.host_memory import HostStaging
from orchestration.checkpoint.state import stage_to_host, tensor_leaves


@dataclass
class SaveJob:
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


def describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def dcp_writer_thread_errors() -> Iterator[list[BaseException]]:
    """What DCP's writer threads raise during one dcp.save. FileSystemWriter(thread_count=n) writes from n - 1
    threads of its own besides the caller; an exception in one of them ends that thread only: Python's default
    hook prints its traceback and dcp.save returns normally, without the files that thread held (torch 2.11 and
    2.13: an EIO injected into the side threads gave a normal return and a checkpoint that failed to load; a full
    disk printed the threads' tracebacks in a worker's console on a 16-core machine, where io_threads() is 8).
    While this is open, threading.excepthook keeps those exceptions in the list it yields; any other thread's
    exception goes to the hook that was there before, which is put back at the end. When the caller's own writes
    fail, dcp.save raises without joining its threads: they are joined here first, so that none is left writing
    into the directory being removed or reports its error after the hook is gone. One save at a time (a lock)."""
    errors: list[BaseException] = []
    with _WRITER_ERRORS_LOCK:
        previous, threads_before = threading.excepthook, set(threading.enumerate())

        def keep_dcp_writer_errors(args: threading.ExceptHookArgs) -> None:
            if args.exc_value is not None and _raised_in_dcp_writer(args.exc_traceback):
                errors.append(args.exc_value)
            else:
                previous(args)

        threading.excepthook = keep_dcp_writer_errors
        try:
            yield errors
        finally:
            for thread in set(threading.enumerate()) - threads_before:
                if thread.name.endswith(f"({DCP_WRITER_FUNCTION})"):  # Python's default name: "Thread-N (target)"
                    thread.join()  # as dcp.save itself does when its own writes succeed
            if threading.excepthook is keep_dcp_writer_errors:  # unless something replaced it meanwhile
                threading.excepthook = previous


# The function DCP's FileSystemWriter runs in each of its writer threads (torch 2.11 to 2.13).
DCP_WRITER_FUNCTION = "_write_files_from_queue"
_WRITER_ERRORS_LOCK = threading.Lock()


def _raised_in_dcp_writer(tb: Any) -> bool:
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == DCP_WRITER_FUNCTION and "checkpoint" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def deleted_events(deleted: list[tuple[int, Path]], reason: str = "retention") -> list[tuple[str, dict]]:
    return [("checkpoint_deleted", {"step": step, "path": str(path), "reason": reason}) for step, path in deleted]


def write_and_finalize(job: SaveJob, *, rank: int, world_size: int, checksum: str, root: Path,
                       apply_retention: Callable[[], list[tuple[int, Path]]]) -> None:
    """DCP write, small files, parallel hashing, manifest and rename (rank 0), retention. Collective over
    job.group. Events go to job.events (emitted by _finish on the caller's thread)."""
    tmp, final, step, group = job.tmp, job.final, job.step, job.group
    t_write = time.perf_counter()
    # Several writer threads (each rank then writes that many files): one thread could not fill the disk's bandwidth
    # (BENCHMARKS.md "Checkpoint stall"). DCP's single-process warning is filtered at import (warnings.catch_warnings is not
    # thread-safe, and this runs in the save thread).
    with dcp_writer_thread_errors() as thread_errors:
        dcp.save(job.tensors, storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR, thread_count=io_threads()),
                 process_group=group)
    # A writer thread that failed left its files unwritten while dcp.save returned: this save fails on every rank,
    # with an OSError where one was raised (a full disk's errno; torch's zip writer then adds "unexpected pos ...").
    first = next((e for e in thread_errors if isinstance(e, OSError)), thread_errors[0]) if thread_errors else None
    error = describe_error(first) if first is not None else None
    try:
        (tmp / rng_file_name(rank)).write_bytes(job.rng_bytes)
        if rank == 0:
            (tmp / STATE_META).write_bytes(job.rest_bytes)
            if job.sched_bytes is not None:
                (tmp / SCHEDULER).write_bytes(job.sched_bytes)
            (tmp / EXTRA_STATE).write_text(job.extra_json, encoding="ascii")
    except OSError as e:
        error = error or describe_error(e)
    sync_errors(error, f"writing {tmp}", group)

    # Hash in parallel: rank 0's listing is the truth (directory caches may lag on network filesystems).
    t_hash = time.perf_counter()
    files = broadcast_from_rank0(list_files(tmp) if rank == 0 else None, group)
    error, digests = None, {}
    try:
        mine = [rel for index, rel in enumerate(files) if index % world_size == rank]
        hashed = file_digests([tmp / rel for rel in mine], checksum, DIGEST_CHUNK_BYTES, io_threads())
        for rel, digest in zip(mine, hashed, strict=True):
            digests[rel] = {"size": (tmp / rel).stat().st_size, "digest": digest}
    except OSError as e:
        error = describe_error(e)
    gathered = gather_to_all((error, digests), group)
    sync_errors(error, f"hashing {tmp}", group)

    error, deleted = None, []
    t_finalize = time.perf_counter()
    if rank == 0:
        try:
            all_digests: dict = {}
            for _, part in gathered:
                all_digests.update(part)
            assert sorted(all_digests) == files, "every listed file is hashed exactly once"
            manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step,
                        "world_size": world_size, "time": time.time(), "good": False,
                        "checksum": checksum, "chunk_bytes": DIGEST_CHUNK_BYTES, "files": all_digests,
                        "torch_version": torch.__version__,
                        "has_scheduler": job.sched_bytes is not None}
            publish(tmp, final, root, manifest)
            deleted = apply_retention()
        except OSError as e:
            error = describe_error(e)
    sync_errors(error, f"finalizing {final}", group)
    t_end = time.perf_counter()
    # Where this rank's save time went (the worker puts it in its checkpoint_timing event): state dicts, the
    # host copies of a background save, the DCP write (device-to-host copies and files), hashing, and the
    # manifest, renames and retention.
    job.timing.update(write_s=round(t_hash - t_write, 3), hash_s=round(t_finalize - t_hash, 3),
                      finalize_s=round(t_end - t_finalize, 3),
                      hashed_bytes=sum(meta["size"] for meta in digests.values()))
    if rank == 0:
        job.events.append(("checkpoint_saved", {"step": step, "path": str(final), "good": False}))
        job.events.extend(deleted_events(deleted))



def publish(tmp: Path, final: Path, root: Path, manifest: dict) -> None:
    """Write the manifest into the complete directory `tmp` and rename it to `final` (rank 0)."""
    write_json_atomic(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    replaced = None
    if final.exists():
        # Re-saving a step (after a rollback): the new one wins; the old one goes via a .tmp name so a crash here
        # never leaves a half-deleted step_ directory (a crash between the renames: recover_replaced at start).
        replaced = root / f"{REPLACED_PREFIX}{final.name}-{os.getpid()}"
        os.rename(final, replaced)
    try:
        os.rename(tmp, final)
    except OSError:
        if replaced is not None:
            os.rename(replaced, final)
        raise
    fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


class NoHardLinks(OSError):
    """The checkpoint's filesystem refused a hard link (EPERM, EXDEV, ENOSYS on FUSE, ...)."""


def link_with_new_extra_state(source: Path, tmp: Path, manifest: dict, extra_json: str) -> dict:
    """Fill `tmp` with hard links to the files of the finalized checkpoint `source` (its `manifest`) and a new
    extra_state.json; return the manifest for `tmp` (good, the new file's size and digest). NoHardLinks when the
    filesystem has none (a copy, rank 0 alone while the others wait, would be slower than a save written by all
    ranks). Rank 0, on the caller's thread."""
    directories = {tmp}
    for rel in sorted(manifest["files"]):
        if rel == EXTRA_STATE:
            continue
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        directories.add(target.parent)
        try:
            os.link(source / rel, target)
        except OSError as e:
            raise NoHardLinks(e.errno, f"cannot hard-link {source / rel}: {e.strerror}") from e
    (tmp / EXTRA_STATE).write_text(extra_json, encoding="ascii")
    fsync_file(tmp / EXTRA_STATE)
    for directory in sorted(directories, reverse=True):  # the links' entries, before publish removes the source
        fsync_dir(directory)
    digest, = file_digests([tmp / EXTRA_STATE], manifest["checksum"], manifest["chunk_bytes"])
    files = dict(manifest["files"])
    files[EXTRA_STATE] = {"size": (tmp / EXTRA_STATE).stat().st_size, "digest": digest}
    now = time.time()
    return {**manifest, "files": files, "time": now, "good": True, "good_time": now}


def stage_job(job: SaveJob, tensors: dict, staging: HostStaging) -> None:
    """Copy the save's tensors into the host buffers of `staging` (job.tensors then points at the copies, job.ready
    is the CUDA event after them). Collective: a rank that cannot pin or copy makes every rank raise."""
    error = None
    cuda = [t.device for t in tensor_leaves(tensors) if t.is_cuda]
    try:  # pinning tens of GB of host memory can fail on one rank: all ranks must learn it before writing
        job.tensors = stage_to_host(tensors, staging)
        if cuda:
            job.device = cuda[0]
            job.ready = torch.cuda.Event()
            job.ready.record()
    except (RuntimeError, OSError) as e:
        error = describe_error(e)
        # Copies queued before the failure may still be landing in the buffers: let them finish before the
        # buffers are unregistered and freed.
        if cuda:
            try:
                torch.cuda.synchronize()
            except RuntimeError:
                pass  # a broken device: its copies are not running either
        staging.release()
    sync_errors(error, f"copying the state of step {job.step} to host memory")
    if staging.last_alloc:  # buffers allocated by this save (its first, or after a reshape)
        job.timing["stage_alloc_s"] = staging.last_alloc["alloc_s"]
        job.timing["stage_new_buffers"] = staging.last_alloc["new_buffers"]
        job.timing["stage_pinned_fallbacks"] = staging.fallbacks
