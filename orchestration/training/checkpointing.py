"""The worker's side of a run's checkpoints: what a resume restores, the start (resume from the newest sound
checkpoint, or a step-0 save), periodic and background saves, good marks, and what a failed save means for the run.

RunCheckpoints works on the worker loop's Trainer (training/loop.py), which holds it as `trainer.checkpoints`; it
reaches the trainer's model, optimizer, state and events through that reference, never by importing loop.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from orchestration.checkpoint.directory import EXTRA_STATE, TMP_PREFIX, CheckpointError
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.checkpoint.state import dcp_failure_summary
from orchestration.config import redact_secrets, to_dict
from orchestration.data.byte_stream import WINDOW_RULE
from orchestration.observability.events import EVENTS_FILE, METRICS_FILE, read_jsonl
from orchestration.training.decisions import apply_policy_precision
from orchestration.training.optimizer import set_learning_rate


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
class TrainState:
    """Everything besides model/optimizer/scheduler that a resume must restore exactly."""

    step: int = 0  # optimizer steps taken (the next step to run)
    cursor: int = 0  # next global sample index
    consumed_ranges: list[list[int]] = field(default_factory=list)  # samples whose update was kept
    skipped_ranges: list[list[int]] = field(default_factory=list)  # samples deliberately dropped (skip, rollback)
    precision: str = "fp8"
    lr_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.cursor, "consumed_ranges": self.consumed_ranges,
                "skipped_ranges": self.skipped_ranges, "precision": self.precision, "lr_scale": self.lr_scale}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        return cls(**{k: data[k] for k in ("step", "cursor", "consumed_ranges", "skipped_ranges", "precision",
                                            "lr_scale") if k in data})


@dataclass
class Resumed:
    """What RunCheckpoints.load_latest found and loaded, for the events RunCheckpoints.begin writes after it."""

    info: Any  # the manager's CheckpointInfo
    load_s: float
    previous_events: list[dict[str, Any]]


class RunCheckpoints:
    """One worker's checkpoints for the length of one worker-group lifetime; `manager` is the CheckpointManager."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        job = trainer.job
        self.corrupt: list[dict[str, Any]] = []  # checkpoint_corrupt events of this worker's manager
        self.save_blocking_s: float | None = None  # how long training stood still for the background save in flight
        # Saves that passed good_after_steps clean steps while still being written: good once finalized.
        self.earned_good: set[int] = set()
        self.manager = CheckpointManager(trainer.run_dir.checkpoints, keep_last=job.checkpoint.keep_last,
                                         keep_good=job.checkpoint.keep_good, rank=trainer.rank,
                                         world_size=trainer.world_size, event_sink=self._event_sink)

    def _event_sink(self, event: str, fields: dict[str, Any]) -> None:
        t = self.trainer
        if event == "checkpoint_corrupt":
            self.corrupt.append(dict(fields))
        if t.rank == 0:
            record = t.run_dir.event(event, fields.pop("step", t.state.step), **fields)
            guard = getattr(t, "guard", None)
            if guard is not None:
                guard.log_event(record)

    @property
    def async_saves(self) -> bool:
        """Whether periodic saves are written in the background (checkpoint.async_save)."""
        mode = self.trainer.job.checkpoint.async_save
        return mode == "always" or (mode == "auto" and self.trainer.device.type == "cuda")

    # -- start / resume -------------------------------------------------------------------------------------
    def load_latest(self) -> Resumed | None:
        """Load the newest sound checkpoint into the trainer, if the run has one (None: a fresh start)."""
        t = self.trainer
        previous = read_jsonl(t.run_dir.path / EVENTS_FILE)
        # Collective: every rank must resume from the same checkpoint even if one of them sees a corrupt file.
        # Always, whatever checkpoint.resume says: the driver refuses resume=false over a run that has checkpoints
        # (orchestration.driver.start_checks.check_start), so checkpoints found here are this start's own, and a Ray
        # restart after a lost worker must continue from them, not train again from step 0.
        info = self.manager.latest(collective=True)
        if info is None and t.job.checkpoint.resume and self.manager.finalized():
            # Every checkpoint failed verification (checkpoint_corrupt events name each): starting from step 0 here
            # would mix two runs and let retention delete the new ones while the corrupt newer ones count.
            damage = "; ".join(f"{Path(e['path']).name}: {e['reason']}" for e in self.corrupt)
            raise RunFailed(f"run directory {t.run_dir.path} cannot resume: every checkpoint is damaged "
                            f"({damage or 'see the checkpoint_corrupt events'}). Start the run over in its "
                            "directory with checkpoint.resume=false, or choose a new run_name (nothing was "
                            "changed on disk)")
        if info is None:
            return None
        t_load = time.time()
        self.check_resumable(info)
        self.restore_extra(self.manager.load(info, t.model, t.optimizer, t.scheduler))
        # Verdicts still pending when the previous group stopped: keep waiting for them (a trouble step since then,
        # in the restored guard's last_bad_step, still rules them out).
        self.manager.awaiting_good.update(self.manager.unjudged_steps(info.step))
        if self.async_saves:
            # A restart's first background save would otherwise get its host buffers while training waits.
            self.manager.prepare_staging(t.model, t.optimizer)
        return Resumed(info, time.time() - t_load, previous)

    def begin(self, resumed: Resumed | None) -> None:
        """After worker_group_start: the resume's events (a Ray restart's worker_lost / workers_added, then resume),
        or on a fresh start the step-0 checkpoint, good by definition, so a rollback always has somewhere to go
        (none with checkpoint.every_steps=0: checkpoints off)."""
        t = self.trainer
        if resumed is None:
            if t.job.checkpoint.every_steps:
                # In the background with async saves: written synchronously it stood training still for the whole
                # write (BENCHMARKS.md "Checkpoint stall").
                self.save(good=True, background=self.async_saves)
            return
        previous = resumed.previous_events
        last_group = [e for e in previous if e["event"] == "worker_group_start"]
        # Last sign of life of the previous group: its newest event or metrics line.
        last_metrics = read_jsonl(t.run_dir.path / METRICS_FILE)[-1:]
        last_seen = max([e["time"] for e in previous] + [m["time"] for m in last_metrics if "time" in m],
                        default=time.time())
        # A driver's run_start after the last group: a new start of the run (a resume), not a Ray restart.
        unfinished = bool(last_group) and not any(
            e["event"] in ("run_end", "run_start") and e["time"] >= last_group[-1]["time"] for e in previous)
        if unfinished:
            # Ray Train restarted the group: smaller or equal size = a worker was lost (node gone, process
            # crashed); larger = the cluster gained room and the elastic policy grew the group.
            before = last_group[-1]["world_size"]
            t.event("worker_lost" if t.world_size <= before else "workers_added",
                    previous_world_size=before, world_size=t.world_size, last_seen_time=last_seen)
        t.event("resume", from_step=t.state.step, world_size=t.world_size,
                checkpoint=str(resumed.info.path), downtime_s=round(time.time() - last_seen, 3),
                setup_s=round(t.setup_s, 3), checkpoint_load_s=round(resumed.load_s, 3),
                origin="restart" if unfinished else "new_start",
                metrics_superseded=self.drop_superseded_metrics(t.state.step))

    def drop_superseded_metrics(self, from_step: int) -> int:
        """Rank 0, on resume: remove metrics.jsonl's lines of the steps after `from_step` (written by the start that
        died after its last checkpoint; they are trained again now, and two lines for one step would read as two
        different losses). Returns how many were removed."""
        t = self.trainer
        if t.rank != 0:
            return 0
        path = t.run_dir.path / METRICS_FILE
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
        t = self.trainer
        run_dir = t.run_dir.path
        extra = json.loads((Path(info.path) / EXTRA_STATE).read_text())
        saved_model = extra.get("model")
        if saved_model is not None and saved_model != t.job.model.name:
            raise ValueError(f"run directory {run_dir} holds checkpoints of model '{saved_model}', not "
                             f"'{t.job.model.name}': choose a new run_name (nothing was changed on disk)")
        saved_corpus, corpus = extra.get("data_corpus"), getattr(t.dataset, "identity", None)
        if (saved_corpus is not None or corpus is not None) and saved_corpus != corpus:
            what = ("the byte stream (data=stdlib)" if saved_corpus is None else "data=tokenized" if corpus is None
                    else "; ".join(f"{k} saved {saved_corpus.get(k)!r}, now {corpus.get(k)!r}" for k in sorted(corpus)
                                   if saved_corpus.get(k) != corpus.get(k)))
            raise ValueError(f"run directory {run_dir} was trained on another corpus ({what}): resuming would "
                             "not replay the same samples; point data.path at that corpus or choose a new run_name "
                             "(nothing was changed on disk)")
        saved_data = extra.get("data_fingerprint")
        if saved_data is not None and saved_data != t.dataset.fingerprint:
            raise ValueError(f"run directory {run_dir} was trained on another corpus (fingerprint "
                             f"{saved_data}, now {t.dataset.fingerprint}): resuming would not replay the same "
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
        t = self.trainer
        return {"seed": t.job.data.seed, "seq_len": t.job.data.seq_len, "window_rule": t.dataset.window_rule}

    def restore_extra(self, extra: dict[str, Any]) -> None:
        """Put a loaded checkpoint's extra state (train state, FP8 scales, guard, learning rate) into the trainer."""
        t = self.trainer
        t.state = TrainState.from_dict(extra["train_state"])
        if t.recipe is not None:
            import fp8

            if "precision_state" in extra:
                fp8.load_precision_state(t.model, extra["precision_state"])
        if "guard" in extra:
            t.guard.load_state_dict(extra["guard"])
            apply_policy_precision(t)
        set_learning_rate(t.optimizer, t.job, t.state.step, t.state.lr_scale)

    def extra_state(self) -> dict[str, Any]:
        t = self.trainer
        extra: dict[str, Any] = {"train_state": t.state.to_dict(), "plan": t.plan.to_dict(),
                                 "model": t.job.model.name,
                                 "guard": t.guard.state_dict(), "data_fingerprint": t.dataset.fingerprint,
                                 "data_sampling": self.data_sampling(),
                                 # What the driver compares a resume's settings with (config.yaml alone is
                                 # rewritten at each start, and may be gone).
                                 "job_config": redact_secrets(to_dict(t.job))}
        if getattr(t.dataset, "identity", None) is not None:  # a prepared corpus: what a resume must find again
            extra["data_corpus"] = t.dataset.identity
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
        t = self.trainer
        self.collect()
        t0 = time.time()
        # With background saves on, synchronous ones also write from the pinned host copy (3x faster on the H200).
        try:
            path = self.manager.save(t.state.step, t.model, t.optimizer, t.scheduler, self.extra_state(),
                                     background=background, stage=self.async_saves)
        except (CheckpointError, CheckpointException) as exc:
            self.failed(t.state.step, exc)
        if good and not background:
            self.manager.mark_good(t.state.step)
        else:
            self.manager.awaiting_good.add(t.state.step)  # waits for good_after_steps clean steps; retention keeps it
            if good:
                self.earned_good.add(t.state.step)  # good once written (maybe_mark_good)
        if background:
            self.save_blocking_s = round(time.time() - t0, 3)
            return path
        t.event("checkpoint_timing", seconds=round(time.time() - t0, 3), **self.manager.last_save_timing)
        self.report_to_ray(path)
        return path

    def resave_after_rollback(self, info: Any) -> None:
        """The checkpoint a rollback just loaded, saved again with what the rollback decided (extra_state) and its
        other files linked, not written; written in full where the filesystem has no hard links. Synchronous: a
        restart before it is published would replay the skipped samples."""
        t = self.trainer
        t0 = time.time()
        try:
            path = self.manager.resave_extra_state(info, self.extra_state())
        except (CheckpointError, CheckpointException) as exc:
            self.failed(info.step, exc)
        t.event("checkpoint_timing", seconds=round(time.time() - t0, 3), **self.manager.last_save_timing)
        if path is None:  # the event says why (no_hard_links); the full save has its own
            self.save(good=True)
            return
        self.report_to_ray(path)

    def maybe_mark_good(self) -> None:
        """A checkpoint is good once monitor.good_after_steps steps after it passed the monitors
        (docs/run-directory.md). The clean steps are counted from the save, not from the end of its write: one still
        being written in the background when they pass is marked good when it is finalized (a large save outlasts
        many steps: counted from its end, a loss spike during the write rolled back one checkpoint further)."""
        t = self.trainer
        last_bad = t.guard.last_bad_step
        for step in sorted(self.manager.awaiting_good - self.earned_good):
            if last_bad is not None and last_bad >= step:
                self.manager.awaiting_good.discard(step)  # trouble first: never good (retention may drop it)
            elif t.state.step - step >= t.job.monitor.good_after_steps:
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
        t = self.trainer
        try:
            finished = self.manager.abandon(timeout_s)
        except Exception as exc:  # noqa: BLE001
            t.event("checkpoint_abandoned", all_ranks=True, error=f"{type(exc).__name__}: {exc}"[:500])
            return
        if finished is not None:
            step, finalized = finished
            t.event("checkpoint_abandoned" if not finalized else "checkpoint_finished_after_error",
                    all_ranks=True, checkpoint_step=step)

    def failed(self, step: int | None, exc: BaseException) -> None:
        """A save failed on every rank (the manager's collectives raise it everywhere): a checkpoint_failed event
        with its cause, its partial directory removed (rank 0), then RunFailed when the disk is full - a restart
        would fail the same way - or the error again for Ray Train to retry."""
        t = self.trainer
        out_of_space = is_out_of_space(exc)
        if t.rank == 0:
            for partial in self.manager.root.glob(f"{TMP_PREFIX}*"):  # this save's; no other save is in flight
                shutil.rmtree(partial, ignore_errors=True)
        newest = self.manager.finalized()[:1]
        needed = sum(p.stat().st_size for p in newest[0][1].rglob("*") if p.is_file()) if newest else 0
        free = shutil.disk_usage(self.manager.root).free
        t.event("checkpoint_failed", checkpoint_step=step, error=save_failure_cause(exc), out_of_space=out_of_space,
                free_bytes=free, checkpoint_bytes=needed or None)
        if not out_of_space:
            raise exc
        root = t.run_dir.path.parent
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
        self.trainer.event("checkpoint_timing", checkpoint_step=step, background=True,
                           seconds=self.save_blocking_s, **timing)
        self.report_to_ray(path, step)

    def report_to_ray(self, path: Path | None, step: int | None = None) -> None:
        """ray.train.report of a finished checkpoint (every rank calls it at the same point: the same save)."""
        t = self.trainer
        if not (t.under_ray and t.job.checkpoint.report_to_ray):
            return
        from orchestration.training.ray_report import ray_keeps_a_copy, report_checkpoint

        # A background save can finish after a rollback discarded its step: every rank still reports (Ray expects the
        # same number of reports from each), without the directory that is gone.
        report_checkpoint({"step": t.state.step if step is None else step, "precision": t.state.precision},
                          path, t.rank, upload=ray_keeps_a_copy(t.job.cluster.storage_path))
