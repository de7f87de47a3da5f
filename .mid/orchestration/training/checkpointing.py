"""The worker's side of a run's checkpoints: what a resume restores, the start (resume from the newest sound
checkpoint, or a step-0 save), periodic and background saves, good marks, and what a failed save means for the run.

RunCheckpoints is given what it saves and restores: the worker's context, its TrainingState and divergence guard, and
the observer its events go to (training/state.py, training/observer.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from orchestration.checkpoint.directory import EXTRA_STATE, TMP_PREFIX, CheckpointError
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.checkpoint.state import dcp_failure_summary
from orchestration.config import redact_secrets, to_dict
from orchestration.data.byte_stream import WINDOW_RULE
from orchestration.divergence.guard import StepGuard
from orchestration.observability.events import EVENTS_FILE, METRICS_FILE, read_jsonl
from orchestration.training.observer import RunObserver
from orchestration.training.optimizer import set_learning_rate
from orchestration.training.state import TrainingState, WorkerContext


class RunFailed(Exception):
    """A failure that restarting the worker group cannot fix (no space left for a checkpoint, every checkpoint of the
    run corrupt): every rank ends its loop with status "failed" and this message (final_state.json's "error")
    instead of raising to Ray Train, which would retry it max_failures times, each logged as a lost worker."""


# What an out-of-space write looks like once DCP and our collectives have turned it into text (all ranks see the
# same text, so they agree): the errno, or torch's zip writer's short write ("unexpected pos 704 vs 598" was rank
# 0's only trace on a full 45 MB tmpfs, rank 1 had the errno).
OUT_OF_SPACE_MARKERS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "[Errno 28]", "unexpected pos")


def is_out_of_space(exc: BaseException) -> bool:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
    causes = [f[0] if isinstance(f, tuple) else f for e in seen for f in getattr(e, "failures", {}).values()]
    if any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes):
        return True
    text = " ".join(str(e) for e in seen + causes)
    return any(marker in text for marker in OUT_OF_SPACE_MARKERS)


def save_failure_cause(exc: BaseException) -> str:
    """A failed save's cause for its event: the error summary, led by "No space left on device" whenever the disk
    was full, also when the first write to hit it was torch's zip writer, whose own error reads "unexpected pos 704
    vs 598" (one of three disk-full runs in CI)."""
    error = error_summary(exc)
    if is_out_of_space(exc) and os.strerror(errno.ENOSPC) not in error:
        error = f"{os.strerror(errno.ENOSPC)}: {error}"
    return error[:2000]


def error_summary(exc: BaseException) -> str:
    """One line per distinct cause: a DCP failure's per-rank causes without their tracebacks."""
    if isinstance(exc, CheckpointException):
        return f"{type(exc).__name__}: {dcp_failure_summary(exc)}"
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Resumed:
    """What RunCheckpoints.load_latest found and loaded, for the events RunCheckpoints.begin writes after it."""

    info: Any  # the manager's CheckpointInfo
    load_s: float
    previous_events: list[dict[str, Any]]


class RunCheckpoints:
    """One worker's checkpoints for the length of one worker-group lifetime; `manager` is the CheckpointManager."""

    def __init__(self, ctx: WorkerContext, state: TrainingState, guard: StepGuard, observer: RunObserver):
        self.ctx, self.state, self.guard, self.observer = ctx, state, guard, observer
        job = ctx.job
        self.corrupt: list[dict[str, Any]] = []  # checkpoint_corrupt events of this worker's manager
        self.save_blocking_s: float | None = None  # how long training stood still for the background save in flight
        # Saves that passed good_after_steps clean steps while still being written: good once finalized.
        self.earned_good: set[int] = set()
        self.manager = CheckpointManager(ctx.run_dir.checkpoints, keep_last=job.checkpoint.keep_last,
                                         keep_good=job.checkpoint.keep_good, rank=ctx.rank,
                                         world_size=ctx.world_size, event_sink=self._event_sink)

    def _event_sink(self, event: str, fields: dict[str, Any]) -> None:
        if event == "checkpoint_corrupt":
            self.corrupt.append(dict(fields))
        self.observer.event(event, step=fields.pop("step", self.state.step), **fields)

    @property
    def async_saves(self) -> bool:
        """Whether periodic saves are written in the background (checkpoint.async_save)."""
        mode = self.ctx.job.checkpoint.async_save
        return mode == "always" or (mode == "auto" and self.ctx.device.type == "cuda")

    # -- start / resume -------------------------------------------------------------------------------------
    def load_latest(self) -> Resumed | None:
        """Load the newest sound checkpoint into the training state, if the run has one (None: a fresh start)."""
        t, ctx = self.state, self.ctx
        previous = read_jsonl(ctx.run_dir.path / EVENTS_FILE)
        # Collective: every rank must resume from the same checkpoint even if one of them sees a corrupt file.
        # Always, whatever checkpoint.resume says: the driver refuses resume=false over a run that has checkpoints
        # (orchestration.driver.start_checks.check_start), so checkpoints found here are this start's own, and a Ray
        # restart after a lost worker must continue from them, not train again from step 0.
        info = self.manager.latest(collective=True)
        if info is None and ctx.job.checkpoint.resume and self.manager.corrupt_steps:
            # Every checkpoint failed verification (checkpoint_corrupt events name each): starting from step 0 here
            # would mix two runs and let retention delete the new ones while the corrupt newer ones count.
            damage = "; ".join(f"{Path(e['path']).name}: {e['reason']}" for e in self.corrupt)
            raise RunFailed(f"run directory {ctx.run_dir.path} cannot resume: every checkpoint is damaged "
                            f"({damage or 'see the checkpoint_corrupt events'}). Start the run over in its "
                            "directory with checkpoint.resume=false, or choose a new run_name (nothing was "
                            "changed on disk)")
        if info is None:
            return None
        t_load = time.time()
        self.check_resumable(info)
        self.load(info)
        # Verdicts still pending when the previous group stopped: keep waiting for them (a trouble step since then,
        # in the restored guard's last_bad_step, still rules them out).
        self.manager.awaiting_good.update(self.manager.unjudged_steps(info.step))
        if self.async_saves:
            # A restart's first background save would otherwise get its host buffers while training waits.
            self.manager.prepare_staging(t.model, t.optimizer)
        return Resumed(info, time.time() - t_load, previous)

    def begin(self, resumed: Resumed | None, setup_s: float) -> None:
        """After worker_group_start: the resume's events (a Ray restart's worker_lost / workers_added, then resume),
        or on a fresh start the step-0 checkpoint, good by definition, so a rollback always has somewhere to go
        (none with checkpoint.every_steps=0: checkpoints off)."""
        t, ctx = self.state, self.ctx
        if resumed is None:
            if ctx.job.checkpoint.every_steps:
                # In the background with async saves: written synchronously it stood training still for the whole
                # write (BENCHMARKS.md "Checkpoint stall").
                self.save(good=True, background=self.async_saves)
            return
        previous = resumed.previous_events
        last_group = [e for e in previous if e["event"] == "worker_group_start"]
        # Last sign of life of the previous group: its newest event or metrics line.
        last_metrics = read_jsonl(ctx.run_dir.path / METRICS_FILE)[-1:]
        last_seen = max([e["time"] for e in previous] + [m["time"] for m in last_metrics if "time" in m],
                        default=time.time())
        # A driver's run_start after the last group: a new start of the run (a resume), not a Ray restart.
        unfinished = bool(last_group) and not any(
            e["event"] in ("run_end", "run_start") and e["time"] >= last_group[-1]["time"] for e in previous)
        if unfinished:
            # Ray Train restarted the group: smaller or equal size = a worker was lost (node gone, process
            # crashed); larger = the cluster gained room and the elastic policy grew the group.
            before = last_group[-1]["world_size"]
            self.observer.event("worker_lost" if ctx.world_size <= before else "workers_added",
                                previous_world_size=before, world_size=ctx.world_size, last_seen_time=last_seen)
        self.observer.event("resume", from_step=t.step, world_size=ctx.world_size,
                            checkpoint=str(resumed.info.path), downtime_s=round(time.time() - last_seen, 3),
                            setup_s=round(setup_s, 3), checkpoint_load_s=round(resumed.load_s, 3),
                            origin="restart" if unfinished else "new_start",
                            metrics_superseded=self.drop_superseded_metrics(t.step))

    def drop_superseded_metrics(self, from_step: int) -> int:
        """Rank 0, on resume: remove metrics.jsonl's lines of the steps after `from_step` (written by the start that
        died after its last checkpoint; they are trained again now, and two lines for one step would read as two
        different losses). Returns how many were removed."""
        ctx = self.ctx
        if ctx.rank != 0:
            return 0
        path = ctx.run_dir.path / METRICS_FILE
        records = read_jsonl(path)
        kept = [m for m in records if m.get("step", 0) <= from_step]
        if len(kept) < len(records):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
            os.replace(tmp, path)
        return len(records) - len(kept)

    def check_resumable(self, info: Any) -> None:
        """Refuse, with what to change, a checkpoint of another model, corpus or sample mapping (same run_name
        reused, or a checkpoint without the current window rule)."""
        ctx = self.ctx
        run_dir = ctx.run_dir.path
        extra = json.loads((Path(info.path) / EXTRA_STATE).read_text())
        saved_model = extra.get("model")
        if saved_model is not None and saved_model != ctx.job.model.name:
            raise ValueError(f"run directory {run_dir} holds checkpoints of model '{saved_model}', not "
                             f"'{ctx.job.model.name}': choose a new run_name (nothing was changed on disk)")
        saved_corpus, corpus = extra.get("data_corpus"), getattr(ctx.dataset, "identity", None)
        if (saved_corpus is not None or corpus is not None) and saved_corpus != corpus:
            what = ("the byte stream (data=stdlib)" if saved_corpus is None else "data=tokenized" if corpus is None
                    else "; ".join(f"{k} saved {saved_corpus.get(k)!r}, now {corpus.get(k)!r}" for k in sorted(corpus)
                                   if saved_corpus.get(k) != corpus.get(k)))
            raise ValueError(f"run directory {run_dir} was trained on another corpus ({what}): resuming would "
                             "not replay the same samples; point data.path at that corpus or choose a new run_name "
                             "(nothing was changed on disk)")
        saved_data = extra.get("data_fingerprint")
        if saved_data is not None and saved_data != ctx.dataset.fingerprint:
            raise ValueError(f"run directory {run_dir} was trained on another corpus (fingerprint "
                             f"{saved_data}, now {ctx.dataset.fingerprint}): resuming would not replay the same "
                             "samples; restore data.* or choose a new run_name (nothing was changed on disk)")
        saved_sampling = extra.get("data_sampling") or {}
        rule = saved_sampling.get("window_rule")
        if rule != WINDOW_RULE:
            # Sample i's window depends on the rule: resuming under another one would train on other samples than
            # the ones the run's consumed ranges record.
            raise ValueError(f"checkpoint {info.path} maps sample indices to windows with "
                             f"{'no recorded window rule' if rule is None else f'window rule {rule!r}'}, and this "
                             f"version reads rule {WINDOW_RULE} only: resuming would not replay the same samples; "
                             "choose a new run_name (nothing was changed on disk)")
        sampling = self.data_sampling()
        if saved_sampling != sampling:
            raise ValueError(f"run directory {run_dir} maps sample indices with data settings "
                             f"{saved_sampling}, now {sampling}: resuming would not replay the same samples; "
                             "restore them or choose a new run_name (nothing was changed on disk)")

    def data_sampling(self) -> dict[str, int]:
        """The data settings that decide which window a sample index reads (beside the corpus fingerprint)."""
        ctx = self.ctx
        return {"seed": ctx.job.data.seed, "seq_len": ctx.job.data.seq_len, "window_rule": ctx.dataset.window_rule}

    def load(self, info: Any) -> None:
        """Load checkpoint `info` into the training state (resharded if the world size changed) with its extra state:
        progress, FP8 scales, guard, learning rate."""
        t = self.state
        extra = self.manager.load(info, t.model, t.optimizer, t.scheduler)
        t.load_progress(extra["train_state"])
        if t.recipe is not None:
            import fp8

            if "precision_state" in extra:
                fp8.load_precision_state(t.model, extra["precision_state"])
        if "guard" in extra:
            self.guard.load_state_dict(extra["guard"])
            t.follow_policy_precision(self.guard)
        set_learning_rate(t.optimizer, self.ctx.job, t.step, t.lr_scale)
        t.weights_changed(f"checkpoint {Path(info.path).name} loaded")

    def discard_newer_than_current(self) -> None:
        """After a rollback: the checkpoints past the step it went back to are gone (rank 0 deletes them), and none of
        them waits for a good mark any more."""
        step = self.state.step
        if self.ctx.rank == 0:
            self.manager.discard_newer_than(step)
        self.manager.awaiting_good = {s for s in self.manager.awaiting_good if s <= step}

    def extra_state(self) -> dict[str, Any]:
        t, ctx = self.state, self.ctx
        extra: dict[str, Any] = {"train_state": t.progress(), "plan": ctx.plan.to_dict(),
                                 "model": ctx.job.model.name,
                                 "guard": self.guard.state_dict(), "data_fingerprint": ctx.dataset.fingerprint,
                                 "data_sampling": self.data_sampling(),
                                 # What the driver compares a resume's settings with (config.yaml alone is
                                 # rewritten at each start, and may be gone).
                                 "job_config": redact_secrets(to_dict(ctx.job))}
        if getattr(ctx.dataset, "identity", None) is not None:  # a prepared corpus: what a resume must find again
            extra["data_corpus"] = ctx.dataset.identity
        if t.recipe is not None:
            import fp8

            extra["precision_state"] = fp8.precision_state(t.model)
        return extra

    # -- saves ----------------------------------------------------------------------------------------------
    def save(self, good: bool = False, background: bool = False) -> Path:
        """Save the current step. background: copy to host memory and write in a thread (periodic saves and the
        step-0 one with checkpoint.async_save); its checkpoint_timing event and Ray report follow when it finishes
        (collect, at the next save or at the end). good=True saves (start, after a rollback) are good by definition:
        marked at once, or once written when in the background (a rollback collects it first)."""
        t = self.state
        self.collect()
        t0 = time.time()
        # With background saves on, synchronous ones also write from the pinned host copy (3x faster on the H200).
        try:
            path = self.manager.save(t.step, t.model, t.optimizer, t.scheduler, self.extra_state(),
                                     background=background, stage=self.async_saves)
        except (CheckpointError, CheckpointException) as exc:
            self.failed(t.step, exc)
        if good and not background:
            self.manager.mark_good(t.step)
        else:
            self.manager.awaiting_good.add(t.step)  # waits for good_after_steps clean steps; retention keeps it
            if good:
                self.earned_good.add(t.step)  # good once written (maybe_mark_good)
        if background:
            self.save_blocking_s = round(time.time() - t0, 3)
            return path
        self.observer.event("checkpoint_timing", seconds=round(time.time() - t0, 3), **self.manager.last_save_timing)
        self.report_to_ray(path)
        return path

    def resave_after_rollback(self, info: Any) -> None:
        """The checkpoint a rollback just loaded, saved again with what the rollback decided (extra_state) and its
        other files linked, not written; written in full where the filesystem has no hard links. Synchronous: a
        restart before it is published would replay the skipped samples."""
        t0 = time.time()
        try:
            path = self.manager.resave_extra_state(info, self.extra_state())
        except (CheckpointError, CheckpointException) as exc:
            self.failed(info.step, exc)
        self.observer.event("checkpoint_timing", seconds=round(time.time() - t0, 3), **self.manager.last_save_timing)
        if path is None:  # the event says why (no_hard_links); the full save has its own
            self.save(good=True)
            return
        self.report_to_ray(path)

    def maybe_mark_good(self) -> None:
        """A checkpoint is good once monitor.good_after_steps steps after it passed the monitors
        (docs/run-directory.md). The clean steps are counted from the save, not from the end of its write: one still
        being written in the background when they pass is marked good when it is finalized (a large save outlasts
        many steps: counted from its end, a loss spike during the write rolled back one checkpoint further)."""
        t, ctx = self.state, self.ctx
        last_bad = self.guard.last_bad_step
        for step in sorted(self.manager.awaiting_good - self.earned_good):
            if last_bad is not None and last_bad >= step:
                self.manager.awaiting_good.discard(step)  # trouble first: never good (retention may drop it)
            elif t.step - step >= ctx.job.monitor.good_after_steps:
                self.earned_good.add(step)
        self.mark_earned()

    def mark_earned(self) -> None:
        """Mark good the saves that earned it (maybe_mark_good, or good=True saves) and are written by now."""
        for step in sorted(self.earned_good):
            if not self.manager.save_in_flight(step):
                if step in self.manager.awaiting_good:
                    self.manager.mark_good(step)  # emits checkpoint_good, ends the wait
                    self.manager.awaiting_good.discard(step)
                self.earned_good.discard(step)

    def abandon(self, timeout_s: float = 60.0) -> None:
        """The loop raised: give a background save in flight `timeout_s` to finish (the peers it writes with may be
        gone), then leave it; an event says whether it was finalized. Never raises: the loop's error is the news."""
        try:
            finished = self.manager.abandon(timeout_s)
        except Exception as exc:  # noqa: BLE001
            self.observer.event("checkpoint_abandoned", all_ranks=True, error=f"{type(exc).__name__}: {exc}"[:500])
            return
        if finished is not None:
            step, finalized = finished
            self.observer.event("checkpoint_abandoned" if not finalized else "checkpoint_finished_after_error",
                                all_ranks=True, checkpoint_step=step)

    def failed(self, step: int | None, exc: BaseException) -> None:
        """A save failed on every rank (the manager's collectives raise it everywhere): a checkpoint_failed event
        with its cause, its partial directory removed (rank 0), then RunFailed when the disk is full - a restart
        would fail the same way - or the error again for Ray Train to retry."""
        ctx = self.ctx
        out_of_space = is_out_of_space(exc)
        if ctx.rank == 0:
            for partial in self.manager.root.glob(f"{TMP_PREFIX}*"):  # this save's; no other save is in flight
                shutil.rmtree(partial, ignore_errors=True)
        newest = self.manager.finalized()[:1]
        needed = sum(p.stat().st_size for p in newest[0][1].rglob("*") if p.is_file()) if newest else 0
        free = shutil.disk_usage(self.manager.root).free
        self.observer.event("checkpoint_failed", checkpoint_step=step, error=save_failure_cause(exc), out_of_space=out_of_space,
                            free_bytes=free, checkpoint_bytes=needed or None)
        if not out_of_space:
            raise exc
        root = ctx.run_dir.path.parent
        kept = f"the newest checkpoint, {newest[0][1].name}, is intact" if newest else "no checkpoint was saved"
        raise RunFailed(f"no space left on {root} for a checkpoint of {needed or 'unknown'} bytes ({free} free): "
                        f"free {max(needed - free, 0) or needed or 'some'} bytes or point run_root elsewhere "
                        f"({kept}; resume with the same run_name)") from exc

    def collect(self) -> None:
        """Wait for the background save in flight, if any (its error is raised here), then log its timing - seconds
        is how long training stood still for it, background_s how long the thread took - and report it to Ray."""
        try:
            done = self.manager.wait()
        except (CheckpointError, CheckpointException) as exc:
            self.failed(None, exc)  # its step is in the error's text
        self.mark_earned()
        if done is None:
            return
        step, path, timing = done
        self.observer.event("checkpoint_timing", checkpoint_step=step, background=True,
                            seconds=self.save_blocking_s, **timing)
        self.report_to_ray(path, step)

    def report_to_ray(self, path: Path | None, step: int | None = None) -> None:
        """ray.train.report of a finished checkpoint (every rank calls it at the same point: the same save)."""
        t, ctx = self.state, self.ctx
        if not (ctx.under_ray and ctx.job.checkpoint.report_to_ray):
            return
        from orchestration.training.ray_report import ray_keeps_a_copy, report_checkpoint

        # A background save can finish after a rollback discarded its step: every rank still reports (Ray expects the
        # same number of reports from each), without the directory that is gone.
        report_checkpoint({"step": t.step if step is None else step, "precision": t.precision},
                          path, ctx.rank, upload=ray_keeps_a_copy(ctx.job.cluster.storage_path))
