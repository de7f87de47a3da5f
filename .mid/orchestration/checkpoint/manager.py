"""Checkpoints: DCP save/load in atomic directories with a manifest, checksums and retention.

One checkpoint is a directory `root/step_000123/` (its files: directory.py).

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
   scheduler, the RNG of this rank, and returns the extra state (reader.py). Loading never deletes anything.
5. `resave_extra_state` (after a rollback loaded a checkpoint): the same step published again, good, with new extra
   state; its other files (tensors, state_meta, scheduler, RNG) are hard links to the loaded ones (where the
   filesystem has none, the caller saves the step in full). The old step_N goes aside as .tmp-replaced-step_N-PID;
   a crash between the two renames is undone by the next start (the new directory if complete, else the old one).
   state_meta's optimizer `lr` is the old one: every load sets the learning rate from the schedule and the extra
   state's lr_scale.

RNG on load: with the same world size, each rank gets back exactly the states it saved. With a different world
size there is no meaningful mapping of old ranks to new ones, so every rank seeds torch (CPU and all CUDA
devices), python `random` and numpy from `derive_rng_seed(seed, step, rank)`: a pure function of the manager's
seed, the checkpoint step and the new rank, so a resumed run is reproducible for a given world size.

Events go to `event_sink(name, payload)`; each payload has `step`. `checkpoint_saved` (path, step, good: False, True
from resave_extra_state), `checkpoint_good` (path, step), `checkpoint_deleted` (path, step, reason) and
`checkpoint_loaded` come from rank 0;
`checkpoint_corrupt` (path, step, reason) comes from the rank that found it (from rank 0 only when `latest` runs
collectively). Give non-zero ranks a sink that drops events if only rank 0 should write the event log.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orchestration.checkpoint.collectives import broadcast_from_rank0, dist_on, gather_to_all, sync_errors
from orchestration.checkpoint.directory import (
    MANIFEST,
    REPLACED_PREFIX,
    RNG_DIR,
    STEP_DIR_RE,
    TMP_PREFIX,
    CheckpointError,
    CheckpointInfo,
    io_threads,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
    weights_only_bytes,
    write_json_atomic,
)
from orchestration.checkpoint.host_memory import HostStaging, tensor_specs
from orchestration.checkpoint.reader import read_into
from orchestration.checkpoint.rng import capture_rng_state
from orchestration.checkpoint.state import model_and_optimizer_state, split_tensors
from orchestration.checkpoint.writer import (
    NoHardLinks,
    SaveJob,
    deleted_events,
    describe_error,
    link_with_new_extra_state,
    publish,
    stage_job,
    write_and_finalize,
)

EventSink = Callable[[str, dict], None]

# DCP warns on every call that it runs single-process when no process group exists: intended here (world size 1).
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _extra_json(extra_state: dict) -> str:
    if not isinstance(extra_state, dict):
        raise TypeError(f"extra_state must be a dict, got {type(extra_state).__name__}")
    try:
        return json.dumps(extra_state, indent=1, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_state must be JSON-serialisable (convert tensors with .item()/.tolist()): {e}") from e


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
        dist_rank = dist.get_rank() if dist_on() else 0
        dist_world = dist.get_world_size() if dist_on() else 1
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")
        if dist_on() and (self.rank, self.world_size) != (dist_rank, dist_world):
            raise ValueError(f"rank/world_size {self.rank}/{self.world_size} disagree with the initialized "
                             f"process group ({dist_rank}/{dist_world}); leave them out to use the group's")
        self.keep_last = keep_last
        self.keep_good = keep_good
        # Steps whose good/bad verdict is still pending (the worker waits monitor.good_after_steps clean steps):
        # retention keeps them, or a short every_steps would delete a checkpoint before it could be marked good.
        self.awaiting_good: set[int] = set()
        # Steps that latest() found corrupt or unreadable: retention neither counts nor deletes them (three corrupt
        # newer checkpoints made keep_last=3 delete the step 0 of a run started over beside them).
        self.corrupt_steps: set[int] = set()
        self.seed = seed
        self.checksum = checksum
        self.event_sink = event_sink
        self.last_load_rng: str | None = None  # "restored" or "derived" after load()
        self.last_save_timing: dict[str, float] = {}  # this rank's share of the last save (see save)
        self._pending: SaveJob | None = None  # the background save in flight
        self._unreported: SaveJob | None = None  # finished background save not yet returned by wait()
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
            self._recover_replaced()
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

    def _recover_replaced(self) -> None:
        """A crash between the two renames of a step saved again (writer.publish) left no step_N: its old directory
        is .tmp-replaced-step_N-PID and the new one, complete once its manifest is in, .tmp-step_N. The new one is
        put in place if complete, else the old one (a rollback's re-save would otherwise lose its only good target)."""
        for replaced in sorted(self.root.glob(f"{REPLACED_PREFIX}step_*")):
            name = replaced.name[len(REPLACED_PREFIX):].rsplit("-", 1)[0]
            final = self.root / name
            if not STEP_DIR_RE.match(name) or final.exists():
                continue
            new = self.root / f"{TMP_PREFIX}{name}"
            try:
                os.rename(new if (new / MANIFEST).is_file() else replaced, final)
            except OSError as e:
                raise ValueError(f"checkpoint {final} was being replaced when a run stopped and cannot be put back "
                                 f"from {replaced} ({e}): rename it to {final.name} by hand") from e

    def _tmp_dirs(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir()]

    def finalized(self) -> list[tuple[int, Path]]:
        """(step, path) of every `step_*` directory, newest first; not verified."""
        self._require_root()
        out = []
        for p in self.root.iterdir():
            m = STEP_DIR_RE.match(p.name)
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
        synchronous save. Why: DCP's own device-to-host copies go to pageable memory and made up most of a save's
        time on the GPU machines (BENCHMARKS.md "Checkpoint stall").
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        extra_json = _extra_json({} if extra_state is None else extra_state)
        if not dist_on() and self.world_size != 1:
            raise ValueError(f"save with world_size {self.world_size} needs an initialized process group (every "
                             f"rank writes its shard); initialize torch.distributed or use world_size=1")
        self._join()  # one save at a time: the staging buffers are reused
        self.corrupt_steps.discard(step)  # a corrupt checkpoint of this step is replaced by this save
        self._require_root()

        # Everything that can fail on bad input runs before the first collective, identically on every rank.
        t_start = time.perf_counter()
        state = model_and_optimizer_state(model, optimizer)
        tensors, rest = split_tensors(state)
        rest_bytes = weights_only_bytes(rest, "the non-tensor part of the model/optimizer state")
        sched_bytes = None
        if scheduler is not None:
            sched_bytes = weights_only_bytes(scheduler.state_dict(), "the LR scheduler state_dict")
        rng_bytes = weights_only_bytes(capture_rng_state(), "the RNG state")

        name = step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{name}"
        error = None
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / RNG_DIR).mkdir(parents=True)
            except OSError as e:
                error = describe_error(e)
        sync_errors(error, f"creating {tmp}")
        job = SaveJob(step=step, tmp=tmp, final=self.root / name, tensors=tensors, rng_bytes=rng_bytes,
                       rest_bytes=rest_bytes, sched_bytes=sched_bytes, extra_json=extra_json, group=None)
        t_stage = time.perf_counter()
        job.timing["state_s"] = round(t_stage - t_start, 3)
        if background if stage is None else stage:
            stage_job(job, tensors, self._staging)
            job.timing["stage_s"] = round(time.perf_counter() - t_stage, 3)
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

    def resave_extra_state(self, info: CheckpointInfo, extra_state: dict) -> Path | None:
        """Collective: publish checkpoint `info` again as good, with `extra_state` and hard links to its other files
        (rank 0 writes). For a rollback, whose model, optimizer, scheduler and RNG are the ones just loaded from
        `info`: writing them again was most of a rollback's time from decision to next step (docs/reliability.md).
        The manifest keeps the world size that wrote the tensors and RNG states; a load at another size
        reshards and derives the RNG, as for any checkpoint. Returns None, changing nothing, where the filesystem
        has no hard links: the caller saves the step in full then."""
        extra_json = _extra_json(extra_state)
        self._join()
        self._require_root()
        t_start = time.perf_counter()
        final = self.path_for(info.step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        error, no_links, deleted = None, None, []
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
                # info.manifest: the one `latest` verified against the files being linked
                manifest = link_with_new_extra_state(info.path, tmp, info.manifest, extra_json)
                publish(tmp, final, self.root, manifest)
                deleted = self._apply_retention()
            except NoHardLinks as e:
                shutil.rmtree(tmp, ignore_errors=True)
                no_links = str(e)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                error = describe_error(e)
        sync_errors(error, f"saving step {info.step} again with new extra state from {info.path}")
        no_links = broadcast_from_rank0(no_links)
        self.last_save_timing = {"resave_s": round(time.perf_counter() - t_start, 3)}
        if no_links is not None:
            self.last_save_timing["no_hard_links"] = no_links
            return None
        self.last_save_timing["linked_files"] = len(info.manifest["files"]) - 1  # all but the extra state
        self.corrupt_steps.discard(info.step)
        self.awaiting_good.discard(info.step)
        if self.rank == 0:
            self._emit("checkpoint_saved", {"step": info.step, "path": str(final), "good": True})
            self._emit("checkpoint_good", {"step": info.step, "path": str(final)})
            self._emit_deleted(deleted)
        return final

    def prepare_staging(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Allocate the host buffers of staged saves for this state's tensors in a background thread (page-locked
        for GPU tensors), so that the next save finds them ready; that save waits if they are not. Local (no
        collective). Returns the number of buffers being prepared. For a resumed run, whose first save would
        otherwise allocate them while training waits (orchestration/checkpoint/host_memory.py: how, and its cost)."""
        self._join()
        specs = tensor_specs(model_and_optimizer_state(model, optimizer))
        self._staging.prepare(specs)
        return len(specs)

    def _io_group(self) -> Any:
        """A gloo group over all ranks for background saves (None without a process group). Created collectively on
        the first background save, again if the default group was replaced (an in-process re-init)."""
        if not dist_on() or dist.get_world_size() == 1:
            return None
        default = dist.group.WORLD
        if self._io_group_for is not default:
            try:
                self._io_group_handle = dist.new_group(backend="gloo")
            except (RuntimeError, ValueError) as e:
                raise CheckpointError(f"background saves need a gloo group beside the training one and creating it "
                                      f"failed ({describe_error(e)}): set GLOO_SOCKET_IFNAME to the nodes' network interface, "
                                      "or checkpoint.async_save=never") from e
            self._io_group_for = default
        return self._io_group_handle

    def _background_save(self, job: SaveJob) -> None:
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

    def _write_and_finalize(self, job: SaveJob) -> None:
        write_and_finalize(job, rank=self.rank, world_size=self.world_size, checksum=self.checksum, root=self.root,
                           apply_retention=self._apply_retention)

    def _finish(self, job: SaveJob) -> None:
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
            raise CheckpointError(f"background save of step {job.step} failed: {describe_error(job.error)}") from job.error
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
        entries = [(s, p) for s, p in self.finalized() if s not in self.corrupt_steps]
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
        for name, payload in deleted_events(deleted, reason):
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
        use_group = collective and dist_on() and dist.get_world_size() > 1
        share = (self.rank, self.world_size) if use_group else (0, 1)
        listing = None
        if not use_group or self.rank == 0:  # rank 0's listing, when collective
            listing = [(s, str(p), self._is_good(p)) for s, p in self.finalized()]
        if use_group:
            listing = broadcast_from_rank0(listing)
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
                reasons = [r for r in gather_to_all(reason)]
                bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
                reason = "; ".join(f"rank {r}: {why}" for r, why in bad) if bad else None
            if reason is not None and not use_group and not path.exists():
                continue  # deleted by rank 0's retention since we listed it: gone, not corrupt
            if reason is not None:
                self.corrupt_steps.add(step)
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
        extra_state, rng = read_into(info, model, optimizer, scheduler, rank=self.rank, world_size=self.world_size,
                                     seed=self.seed)
        if self.rank == 0:
            self._emit("checkpoint_loaded", {"step": info.step, "path": str(info.path), "from_world_size":
                                             info.world_size, "world_size": self.world_size, "rng": rng})
        self.last_load_rng = rng
        return extra_state
