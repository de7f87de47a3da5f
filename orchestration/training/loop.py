"""The per-worker training loop: a plain function, run by Ray Train workers (or torchrun, or one process in tests).

Per step: grad-accumulated forward/backward over this rank's slice of the global batch, fault hooks, on-device
divergence detectors, ONE all-reduce that agrees on every rank's verdict, the policy's decision (proceed, skip,
fall back to BF16, retry FP8, roll back, stop) taken by all ranks at the same step before optimizer.step(), then
periodic checkpoints that are marked good once the monitors passed the steps after them.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from fp8.linear import Float8Linear
from optim import ChunkedAdamW
from orchestration.checkpoint.directory import CheckpointError
from orchestration.checkpoint.state import dcp_failure_summary
from orchestration.config import redact_secrets, to_dict
from orchestration.data.select import build_datasets
from orchestration.divergence.guard import StepGuard
from orchestration.divergence.policy import Decision
from orchestration.observability.events import (
    CONFIG_FILE,
    EVENTS_FILE,
    FINAL_STATE_FILE,
    METRICS_FILE,
    STOP_FILE,
    RunDir,
    read_jsonl,
)
from orchestration.training.compile import compile_enabled
from orchestration.training.decisions import apply_decision, apply_eval_gap_decision, apply_policy_precision
from orchestration.training.distributed import init_distributed
from orchestration.training.elastic import BatchPlan, count_in_ranges, merge_ranges, plan_batch
from orchestration.training.faults import FaultInjector
from orchestration.training.gc_policy import ManagedGc
from orchestration.training.model_setup import build_training_model
from orchestration.training.optimizer import lr_at, make_optimizer
from orchestration.training.step import MicroBatch, StepModel, compute_loss, train_step
from orchestration.validation import check_preset_device, from_dict


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


def error_summary(exc: BaseException) -> str:
    """One line per distinct cause: a DCP failure's per-rank causes without their tracebacks."""
    if isinstance(exc, CheckpointException):
        return f"{type(exc).__name__}: {dcp_failure_summary(exc)}"
    return f"{type(exc).__name__}: {exc}"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


class Trainer:
    """Owns one worker's model, optimizer, data and guards for the length of one worker-group lifetime."""

    def __init__(self, config: dict[str, Any]):
        t_setup = time.time()
        self.job = from_dict(config["job"])
        job = self.job
        self.info = init_distributed(job.cluster.device)
        self.rank, self.world_size, self.device = self.info.rank, self.info.world_size, self.info.device
        if self.device.type == "cuda":  # the config checked explicit devices; device=auto is known only here
            check_preset_device(job.cluster.env_preset, "rocm" if torch.version.hip is not None else "cuda")
        self.run_dir = RunDir(config["run_dir"], self.rank)
        self.corrupt_checkpoints: list[dict[str, Any]] = []  # checkpoint_corrupt events of this worker's manager
        self.group_id = config.get("group_id") or f"{int(t_setup)}"
        # Set by the Ray driver (orchestration.driver.ray_job); torchrun and in-process tests run without Ray reports.
        self.under_ray = config.get("launcher") == "ray"
        self.plan: BatchPlan = plan_batch(job.train.global_batch_size, job.train.micro_batch_size, self.world_size)
        self.dataset, self.validation = build_datasets(job)
        self.eval_sequences = self.check_validation_set()
        torch.manual_seed(job.train.seed)
        self.model, self.recipe = build_training_model(job, self.world_size, self.device, self.dataset.vocab_size)
        self.compiled = compile_enabled(job, self.device)  # the loss follows the blocks
        self.cuda_graphs = self.compiled and job.model.compile_mode == "reduce-overhead" and self.device.type == "cuda"
        self.optimizer = make_optimizer(job, self.device, self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(s, job))
        self.state = TrainState(precision="fp8" if self.recipe else "bf16")
        self.compute_dtype = _DTYPES[job.precision.compute_dtype]
        self.tokens_per_step = job.train.global_batch_size * job.data.seq_len

        from orchestration.checkpoint.manager import CheckpointManager

        self.ckpt = CheckpointManager(self.run_dir.checkpoints, keep_last=job.checkpoint.keep_last,
                                      keep_good=job.checkpoint.keep_good, rank=self.rank,
                                      world_size=self.world_size, event_sink=self._event_sink)
        self.step_model = StepModel(self.model, self.optimizer, self.device, self.compute_dtype, self.compiled,
                                    self.cuda_graphs, self.world_size, job.train.sharding, job.train.grad_clip)
        self.faults = FaultInjector(job.faults, rank=self.rank, marker_dir=self.run_dir.path / "faults")
        self.guard = StepGuard(job.monitor, self.model, fp8_run=self.recipe is not None)
        if self.rank == 0:
            self.guard.start_loggers(job, self.run_dir.path, self.recipe)
        self.stop_requested = False  # agreed by all ranks at a logged step (the driver's Ctrl-C, STOP_FILE)
        if job.faults.kind == "fp8_overflow":
            # Real numerics: an outlier enters the first FP8 layer, so the FP8 health statistics see it.
            target = next((m for m in self.model.modules() if isinstance(m, Float8Linear)), None)
            if target is None:
                raise ValueError("faults=fp8_overflow needs an FP8 model: use precision=fp8")
            self.faults.attach_activation_fault(target, self.rank, lambda: self.state.step)
        if job.faults.kind == "fp8_scale_error":
            # The blocks' FP8 linears (not the output head, whose fused form returns the loss itself).
            targets = [m for name, m in self.model.named_modules()
                       if isinstance(m, Float8Linear) and name.startswith("layers.")]
            if not targets:
                raise ValueError("faults=fp8_scale_error needs an FP8 model: use precision=fp8")
            for target in targets:
                self.faults.attach_fp8_scale_fault(target, self.rank, lambda: self.state.step)
        self.setup_s = time.time() - t_setup

    # -- events ---------------------------------------------------------------------------------------------
    def _event_sink(self, event: str, fields: dict[str, Any]) -> None:
        if event == "checkpoint_corrupt":
            self.corrupt_checkpoints.append(dict(fields))
        if self.rank == 0:
            record = self.run_dir.event(event, fields.pop("step", self.state.step), **fields)
            guard = getattr(self, "guard", None)
            if guard is not None:
                guard.log_event(record)

    def event(self, name: str, all_ranks: bool = False, **fields: Any) -> None:
        """Append to events.jsonl (every worker for agreed decisions, else rank 0) and feed rank 0's loggers."""
        if all_ranks:
            record = self.run_dir.event(name, self.state.step, worker_rank=self.rank, **fields)
        elif self.rank == 0:
            record = self.run_dir.event(name, self.state.step, **fields)
        else:
            return
        guard = getattr(self, "guard", None)
        if guard is not None and self.rank == 0:
            guard.log_event(record)

    # -- start / resume -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.under_ray and self.rank == 0 and not (self.run_dir.path / CONFIG_FILE).is_file():
            # The driver wrote config.yaml there before starting the workers: rank 0 not seeing it means another
            # filesystem, where its metrics, events and checkpoints would be invisible to the driver (a completed
            # run reported as interrupted) and lost with the node.
            raise RuntimeError(f"rank 0 does not see the driver's run directory {self.run_dir.path}: run_root must be "
                               "on a filesystem shared by the driver and every worker node (set run_root, or "
                               "cluster.storage_path to a shared path such as NFS)")
        self.check_same_corpus_on_every_rank()
        previous = [e for e in read_jsonl(self.run_dir.path / EVENTS_FILE)]
        # Collective: every rank must resume from the same checkpoint even if one of them sees a corrupt file.
        # Always, whatever checkpoint.resume says: the driver refuses resume=false over a run that has checkpoints
        # (orchestration.driver.ray_job.check_start), so checkpoints found here are this start's own, and a Ray restart
        # after a lost worker must continue from them, not train again from step 0.
        info = self.ckpt.latest(collective=True)
        if info is None and self.job.checkpoint.resume and self.ckpt.finalized():
            # Every checkpoint failed verification (checkpoint_corrupt events name each): starting from step 0 here
            # would mix two runs and let retention delete the new ones while the corrupt newer ones count.
            damage = "; ".join(f"{Path(e['path']).name}: {e['reason']}" for e in self.corrupt_checkpoints)
            raise RunFailed(f"run directory {self.run_dir.path} cannot resume: every checkpoint is damaged "
                            f"({damage or 'see the checkpoint_corrupt events'}). Start the run over in its "
                            "directory with checkpoint.resume=false, or choose a new run_name (nothing was "
                            "changed on disk)")
        t_load = time.time()
        if info is not None:
            self.check_resumable(info)
            extra = self.ckpt.load(info, self.model, self.optimizer, self.scheduler)
            self.restore_extra(extra)
            # Verdicts still pending when the previous group stopped: keep waiting for them (a trouble step since
            # then, in the restored guard's last_bad_step, still rules them out).
            self.ckpt.awaiting_good.update(self.ckpt.unjudged_steps(info.step))
            if self.async_saves:
                # A restart's first background save would otherwise get its host buffers while training waits.
                self.ckpt.prepare_staging(self.model, self.optimizer)
        load_s = time.time() - t_load
        self.event("worker_group_start", world_size=self.world_size, grad_accum=self.plan.grad_accum,
                   micro_batch_size=self.plan.micro_batch_size, backend=self.info.backend,
                   device=str(self.device), group_id=self.group_id, precision=self.state.precision,
                   recipe=self.recipe, adamw=type(self.optimizer).__name__)
        if self.eval_unavailable:
            self.event("eval_unavailable", reason=self.eval_unavailable)
        if info is not None:
            last_group = [e for e in previous if e["event"] == "worker_group_start"]
            # Last sign of life of the previous group: its newest event or metrics line.
            last_metrics = read_jsonl(self.run_dir.path / METRICS_FILE)[-1:]
            last_seen = max([e["time"] for e in previous] + [m["time"] for m in last_metrics if "time" in m],
                            default=time.time())
            # A driver's run_start after the last group: a new start of the run (a resume), not a Ray restart.
            unfinished = bool(last_group) and not any(
                e["event"] in ("run_end", "run_start") and e["time"] >= last_group[-1]["time"] for e in previous)
            if unfinished:
                # Ray Train restarted the group: smaller or equal size = a worker was lost (node gone, process
                # crashed); larger = the cluster gained room and the elastic policy grew the group.
                before = last_group[-1]["world_size"]
                self.event("worker_lost" if self.world_size <= before else "workers_added",
                           previous_world_size=before, world_size=self.world_size, last_seen_time=last_seen)
            self.event("resume", from_step=self.state.step, world_size=self.world_size,
                       checkpoint=str(info.path), downtime_s=round(time.time() - last_seen, 3),
                       setup_s=round(self.setup_s, 3), checkpoint_load_s=round(load_s, 3),
                       origin="restart" if unfinished else "new_start",
                       metrics_superseded=self.drop_superseded_metrics(self.state.step))
        elif self.job.checkpoint.every_steps:
            # A step-0 checkpoint, good by definition: a rollback always has somewhere to go.
            self.save_checkpoint(good=True)

    def drop_superseded_metrics(self, from_step: int) -> int:
        """Rank 0, on resume: remove metrics.jsonl's lines of the steps after `from_step` (written by the start that
        died after its last checkpoint; they are trained again now, and two lines for one step would read as two
        different losses). Returns how many were removed."""
        if self.rank != 0:
            return 0
        path = self.run_dir.path / METRICS_FILE
        records = read_jsonl(path)
        kept = [m for m in records if m.get("step", 0) <= from_step]
        if len(kept) < len(records):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
            os.replace(tmp, path)
        return len(records) - len(kept)

    def check_same_corpus_on_every_rank(self) -> None:
        """Every rank reads its samples from its own copy of data.source; copies that differ (another Python's
        standard library on one node, a stale file) would train ranks on different data without any error."""
        if self.world_size <= 1:
            return
        fingerprints: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(fingerprints, self.dataset.fingerprint)
        if len(set(fingerprints)) > 1:
            by_rank = ", ".join(f"rank {r}: {f}" for r, f in enumerate(fingerprints))
            raise ValueError(f"the ranks read different corpora from data.source={self.job.data.source!r} "
                             f"({by_rank}): give every node the same files (e.g. a shared path for data.source)")

    def check_resumable(self, info: Any) -> None:
        """Refuse, with what to change, a checkpoint of another model or corpus (same run_name reused)."""
        import json

        from orchestration.checkpoint.directory import EXTRA_STATE

        extra = json.loads((Path(info.path) / EXTRA_STATE).read_text())
        saved_model = extra.get("model")
        if saved_model is not None and saved_model != self.job.model.name:
            raise ValueError(f"run directory {self.run_dir.path} holds checkpoints of model '{saved_model}', not "
                             f"'{self.job.model.name}': choose a new run_name (nothing was changed on disk)")
        saved_corpus, corpus = extra.get("data_corpus"), getattr(self.dataset, "identity", None)
        if (saved_corpus is not None or corpus is not None) and saved_corpus != corpus:
            what = ("the byte stream (data=stdlib)" if saved_corpus is None else "data=tokenized" if corpus is None
                    else "; ".join(f"{k} saved {saved_corpus.get(k)!r}, now {corpus.get(k)!r}" for k in sorted(corpus)
                                   if saved_corpus.get(k) != corpus.get(k)))
            raise ValueError(f"run directory {self.run_dir.path} was trained on another corpus ({what}): resuming would "
                             "not replay the same samples; point data.path at that corpus or choose a new run_name "
                             "(nothing was changed on disk)")
        saved_data = extra.get("data_fingerprint")
        if saved_data is not None and saved_data != self.dataset.fingerprint:
            raise ValueError(f"run directory {self.run_dir.path} was trained on another corpus (fingerprint "
                             f"{saved_data}, now {self.dataset.fingerprint}): resuming would not replay the same "
                             "samples; restore data.* or choose a new run_name (nothing was changed on disk)")
        saved_sampling = extra.get("data_sampling")  # absent in checkpoints older than this check
        # A run keeps the window rule it started with, on every resume: rule 1 where the checkpoint predates the
        # rule's record, so a resume replays exactly the samples the run would have read.
        from orchestration.data.byte_stream import WINDOW_RULES

        rule = (saved_sampling or {}).get("window_rule", 1)
        if rule not in WINDOW_RULES:
            raise ValueError(f"checkpoint {info.path} maps samples with window rule {rule!r}, which this version "
                             f"does not know ({WINDOW_RULES}): resume it with the version that wrote it")
        self.dataset.window_rule = rule
        sampling = self.data_sampling()
        if saved_sampling is not None and {**saved_sampling, "window_rule": rule} != sampling:
            raise ValueError(f"run directory {self.run_dir.path} maps sample indices with data settings "
                             f"{saved_sampling}, now {sampling}: resuming would not replay the same samples; "
                             "restore them or choose a new run_name (nothing was changed on disk)")

    def data_sampling(self) -> dict[str, int]:
        """The data settings that decide which window a sample index reads (beside the corpus fingerprint)."""
        return {"seed": self.job.data.seed, "seq_len": self.job.data.seq_len, "window_rule": self.dataset.window_rule}

    def restore_extra(self, extra: dict[str, Any]) -> None:
        self.state = TrainState.from_dict(extra["train_state"])
        if self.recipe is not None:
            import fp8

            if "precision_state" in extra:
                fp8.load_precision_state(self.model, extra["precision_state"])
        if "guard" in extra:
            self.guard.load_state_dict(extra["guard"])
            apply_policy_precision(self)
        for group in self.optimizer.param_groups:
            group["lr"] = self.job.train.lr * lr_at(self.state.step, self.job) * self.state.lr_scale

    def extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"train_state": self.state.to_dict(), "plan": self.plan.to_dict(),
                                 "model": self.job.model.name,
                                 "guard": self.guard.state_dict(), "data_fingerprint": self.dataset.fingerprint,
                                 "data_sampling": self.data_sampling(),
                                 # What the driver compares a resume's settings with (config.yaml alone is
                                 # rewritten at each start, and may be gone).
                                 "job_config": redact_secrets(to_dict(self.job))}
        if getattr(self.dataset, "identity", None) is not None:  # a prepared corpus: what a resume must find again
            extra["data_corpus"] = self.dataset.identity
        if self.recipe is not None:
            import fp8

            extra["precision_state"] = fp8.precision_state(self.model)
        return extra

    @property
    def async_saves(self) -> bool:
        """Whether periodic saves are written in the background (checkpoint.async_save)."""
        mode = self.job.checkpoint.async_save
        return mode == "always" or (mode == "auto" and self.device.type == "cuda")

    def save_checkpoint(self, good: bool = False, background: bool = False) -> Path:
        """Save the current step. background: copy to host memory and write in a thread (periodic saves with
        checkpoint.async_save); its checkpoint_timing event and Ray report follow when it finishes (collect_checkpoint,
        at the next save or at the end). good=True saves (start, after a rollback) are marked good at once, so they
        are always synchronous."""
        background = background and not good
        self.collect_checkpoint()
        t0 = time.time()
        # With background saves on, synchronous ones also write from the pinned host copy (3x faster on the H200).
        try:
            path = self.ckpt.save(self.state.step, self.model, self.optimizer, self.scheduler, self.extra_state(),
                                  background=background, stage=self.async_saves)
        except (CheckpointError, CheckpointException) as exc:
            self.checkpoint_failed(self.state.step, exc)
        if good:
            self.ckpt.mark_good(self.state.step)
        else:
            self.ckpt.awaiting_good.add(self.state.step)  # waits for good_after_steps clean steps; retention keeps it
        if background:
            self._save_blocking_s = round(time.time() - t0, 3)
            return path
        self.event("checkpoint_timing", seconds=round(time.time() - t0, 3), **self.ckpt.last_save_timing)
        self.report_to_ray(path)
        return path

    def abandon_checkpoint(self, timeout_s: float = 60.0) -> None:
        """The loop raised: give a background save in flight `timeout_s` to finish (the peers it writes with may be
        gone), then leave it; an event says whether it was finalized. Never raises: the loop's error is the news."""
        try:
            finished = self.ckpt.abandon(timeout_s)
        except Exception as exc:  # noqa: BLE001
            self.event("checkpoint_abandoned", all_ranks=True, error=f"{type(exc).__name__}: {exc}"[:500])
            return
        if finished is not None:
            step, finalized = finished
            self.event("checkpoint_abandoned" if not finalized else "checkpoint_finished_after_error",
                       all_ranks=True, checkpoint_step=step)

    def checkpoint_failed(self, step: int | None, exc: BaseException) -> None:
        """A save failed on every rank (the manager's collectives raise it everywhere): a checkpoint_failed event
        with its cause, its partial directory removed (rank 0), then RunFailed when the disk is full - a restart
        would fail the same way - or the error again for Ray Train to retry."""
        from orchestration.checkpoint.directory import TMP_PREFIX

        out_of_space = is_out_of_space(exc)
        if self.rank == 0:
            for partial in self.ckpt.root.glob(f"{TMP_PREFIX}*"):  # this save's; no other save is in flight
                shutil.rmtree(partial, ignore_errors=True)
        newest = self.ckpt.finalized()[:1]
        needed = sum(p.stat().st_size for p in newest[0][1].rglob("*") if p.is_file()) if newest else 0
        free = shutil.disk_usage(self.ckpt.root).free
        self.event("checkpoint_failed", checkpoint_step=step,
                   error=error_summary(exc)[:2000], out_of_space=out_of_space, free_bytes=free,
                   checkpoint_bytes=needed or None)
        if not out_of_space:
            raise exc
        root = self.run_dir.path.parent
        kept = f"the newest checkpoint, {newest[0][1].name}, is intact" if newest else "no checkpoint was saved"
        raise RunFailed(f"no space left on {root} for a checkpoint of {needed or 'unknown'} bytes ({free} free): "
                        f"free {max(needed - free, 0) or needed or 'some'} bytes or point run_root elsewhere "
                        f"({kept}; resume with the same run_name)") from exc

    def collect_checkpoint(self) -> None:
        """Wait for the background save in flight, if any (its error is raised here), then log its timing - seconds
        is how long training stood still for it, background_s how long the thread took - and report it to Ray."""
        try:
            done = self.ckpt.wait()
        except (CheckpointError, CheckpointException) as exc:
            self.checkpoint_failed(None, exc)  # its step is in the error's text
        if done is None:
            return
        step, path, timing = done
        self.event("checkpoint_timing", checkpoint_step=step, background=True,
                   seconds=getattr(self, "_save_blocking_s", None), **timing)
        self.report_to_ray(path, step)

    def report_to_ray(self, path: Path | None, step: int | None = None) -> None:
        """ray.train.report of a finished checkpoint (every rank calls it at the same point: the same save)."""
        if not (self.under_ray and self.job.checkpoint.report_to_ray):
            return
        from orchestration.training.ray_report import ray_keeps_a_copy, report_checkpoint

        # A background save can finish after a rollback discarded its step: every rank still reports (Ray expects the
        # same number of reports from each), without the directory that is gone.
        report_checkpoint({"step": self.state.step if step is None else step, "precision": self.state.precision},
                          path, self.rank, upload=ray_keeps_a_copy(self.job.cluster.storage_path))

    # -- one step -------------------------------------------------------------------------------------------
    def compute_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM loss, weighted MoE aux loss) of one micro-batch, as the step computes it."""
        return compute_loss(self.step_model, inputs, targets)

    def micro_batches(self) -> list[MicroBatch]:
        """This rank's micro-batches of the current step, on the device. An empty micro-batch (uneven split) still
        runs a forward on one sample with weight 0, so every rank issues the same FSDP collectives."""
        plan, base = self.plan, self.state.cursor
        lo, hi = plan.rank_range(self.rank)
        batches = []
        for micro in range(plan.grad_accum):
            start, end = plan.sample_slice(self.rank, micro)
            n = end - start
            inputs, targets = self.dataset.batch(base + (start if n else lo), base + (end if n else lo + 1))
            batches.append(MicroBatch(inputs.to(self.device), targets.to(self.device), plan.loss_weight(n),
                                      n / (hi - lo)))
        return batches

    def shadow_losses(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """When the guard's shadow check is due: this rank's first micro-batch recomputed (no grad) in FP8 as the run
        trains now (layers the policy holds in bf16 stay there) and in all-bf16."""
        if not self.guard.shadow_due(self.state.step):
            return None
        import fp8

        start, end = self.plan.sample_slice(self.rank, 0)
        inputs, targets = self.dataset.batch(self.state.cursor + start, self.state.cursor + end)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with torch.no_grad():
            loss_fp8 = self.compute_loss(inputs, targets)[0]
            fp8.set_precision(self.model, "bf16")
            loss_bf16 = self.compute_loss(inputs, targets)[0]
        apply_policy_precision(self)
        return loss_fp8, loss_bf16

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor,
              gated_update: Callable[[torch.Tensor], bool]) -> tuple[Decision, bool]:
        """The step's divergence check (train_step's `check`): the guard's decision, identical on every rank."""
        return self.guard.check(self.model, self.state.step, loss, grad_norm, gated_update, self.shadow_losses)

    def run(self) -> str:
        with ManagedGc(self.job.train.gc_every_steps) as managed_gc:
            status = self._run_steps(managed_gc)
        if status == "completed" and self.job.checkpoint.every_steps:
            self.save_checkpoint()
        return status

    def _run_steps(self, managed_gc: ManagedGc) -> str:
        job = self.job
        status = "completed"
        t_last_log, tokens_since_log = time.time(), 0
        while self.state.step < job.train.steps:
            t0 = time.time()
            # An injected crash waits for a background save in flight, so that tests know where a restart resumes
            # (tests/test_checkpoint_async.py covers a save cut short: the .tmp- directory is ignored and removed);
            # that save's timing event is not written, and its error, if it failed, replaces the injected crash.
            self.faults.maybe_crash(self.state.step, self.rank, before=self.ckpt.wait)
            step, faults = self.state.step, self.faults
            result = train_step(self.step_model, self.micro_batches(), step, self.check,
                                corrupt_loss=functools.partial(faults.maybe_corrupt_loss, step=step, rank=self.rank),
                                corrupt_grads=functools.partial(faults.maybe_corrupt_grads, step=step, rank=self.rank))
            weighted_loss, aux, grad_norm = result.weighted_loss, result.weighted_aux, result.grad_norm
            action = apply_decision(self, result.decision)
            if action == "stop":
                status = "stopped_divergence"
                break
            if action == "rolled_back":
                continue
            step_range = [self.state.cursor, self.state.cursor + job.train.global_batch_size]
            if result.updated:
                self.state.consumed_ranges = merge_ranges(self.state.consumed_ranges + [step_range])
            else:  # skipped: the bad step never updates the weights
                self.state.skipped_ranges = merge_ranges(self.state.skipped_ranges + [step_range])
            self.state.step += 1
            self.state.cursor += job.train.global_batch_size
            for group in self.optimizer.param_groups:
                group["lr"] = job.train.lr * lr_at(self.state.step, job) * self.state.lr_scale
            self.scheduler.last_epoch = self.state.step
            tokens_since_log += self.tokens_per_step
            eval_fields = self.maybe_evaluate()
            if eval_fields or self.state.step % job.train.log_every == 0 or self.state.step == job.train.steps:
                now = time.time()
                # The eval's seconds are not training time: left out of tokens/s and of the step's time.
                eval_s = eval_fields.get("eval_s", 0.0)
                self.log_metrics(weighted_loss, aux, grad_norm,
                                 tokens_since_log / max(now - t_last_log - eval_s, 1e-9), now - t0 - eval_s,
                                 eval_fields)
                t_last_log, tokens_since_log = now, 0
                if self.stop_requested:
                    status = "interrupted"
                    break
            self.maybe_mark_good()
            every = job.checkpoint.every_steps
            if every and self.state.step % every == 0 and self.state.step < job.train.steps:
                self.save_checkpoint(background=self.async_saves)
            managed_gc.step(self.state.step)
        return status

    def maybe_mark_good(self) -> None:
        """A checkpoint is good once monitor.good_after_steps steps after it passed the monitors (docs/run-directory.md)."""
        last_bad = self.guard.last_bad_step
        for step in sorted(self.ckpt.awaiting_good):
            if last_bad is not None and last_bad >= step:
                self.ckpt.awaiting_good.discard(step)  # trouble after it: never mark it good (retention may drop it)
            elif self.ckpt.save_in_flight(step):
                continue  # still being written in the background: judged once it is finalized, without waiting
            elif self.state.step - step >= self.job.monitor.good_after_steps:
                self.ckpt.mark_good(step)  # emits checkpoint_good, ends the wait
                self.ckpt.awaiting_good.discard(step)

    def check_validation_set(self) -> int:
        """Validation sequences per evaluation: data.eval_sequences, or 0 when train.eval_every=0 or the byte stream
        has no held-out file (a one-file data.source; an event says so). Too few sequences in the held-out data is
        an error naming what to change."""
        job = self.job
        self.eval_unavailable: str | None = None  # why evaluation is off though train.eval_every asks for it
        if job.train.eval_every == 0:
            return 0
        if self.validation is None:
            self.eval_unavailable = (f"no held-out data: data.source={job.data.source!r} has no files after the first "
                                     f"data.max_files={job.data.max_files}; point data.source at a directory with more "
                                     "files, or set train.eval_every=0")
            return 0
        capacity = self.validation.validation_capacity()
        if capacity < job.data.eval_sequences:
            raise ValueError(f"the held-out data holds {capacity} sequences of data.seq_len={job.data.seq_len} tokens, "
                             f"fewer than data.eval_sequences={job.data.eval_sequences}: lower data.eval_sequences, "
                             "prepare the corpus with a larger --val-fraction, or set train.eval_every=0")
        return job.data.eval_sequences

    def maybe_evaluate(self) -> dict[str, Any]:
        """At every train.eval_every-th step and the last one: the held-out loss of the weights as they are now (in
        the precision the run has in force), and its seconds. Collective: every rank gets here at the same step."""
        job = self.job
        due = self.eval_sequences and (self.state.step % job.train.eval_every == 0 or self.state.step == job.train.steps)
        if not due:
            return {}
        from orchestration.training.evaluation import evaluate

        t0 = time.time()

        def run() -> float:
            return evaluate(self.model, self.validation, self.eval_sequences, self.plan.micro_batch_size, self.rank,
                            self.world_size, self.device, lambda x, y: self.compute_loss(x, y)[0])

        fields: dict[str, Any] = {"eval_loss": run()}
        if self.guard.checks_eval_gap:
            # The same weights on the same sequences in BF16 (monitor.eval_gap_max): the FP8 path's cost in quality.
            import fp8

            fp8.set_precision(self.model, "bf16")
            try:
                fields["eval_loss_bf16"] = run()
            finally:
                apply_policy_precision(self)
            fields["eval_gap"] = (fields["eval_loss"] - fields["eval_loss_bf16"]) / abs(fields["eval_loss_bf16"])
            apply_eval_gap_decision(self, self.guard.check_eval_gap(self.state.step, fields["eval_loss"],
                                                                    fields["eval_loss_bf16"]),
                                    fields["eval_loss"], fields["eval_loss_bf16"])
        return {**fields, "eval_s": round(time.time() - t0, 4), "eval_sequences": self.eval_sequences}

    def log_metrics(self, loss: torch.Tensor, aux: torch.Tensor, grad_norm: torch.Tensor, tokens_per_s: float,
                    step_time_s: float, eval_fields: dict[str, Any] | None = None) -> None:
        # The driver's stop request (Ctrl-C) rides on this all-reduce, so every rank sees it at the same step.
        asked = float((self.run_dir.path / STOP_FILE).exists())
        values = torch.stack([loss.float(), aux.float(), grad_norm.float(),
                              torch.tensor(asked, device=loss.device)])
        if self.world_size > 1:
            torch.distributed.all_reduce(values)
            values /= self.world_size
        loss_v, aux_v, gn_v, stop_v = values.tolist()
        self.stop_requested = stop_v > 0
        record = {"step": self.state.step, "loss": loss_v, "aux_loss": aux_v,
                  "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": gn_v, "tokens_per_s": tokens_per_s,
                  "step_time_s": step_time_s, "world_size": self.world_size, "precision": self.state.precision,
                  "samples_consumed": count_in_ranges(self.state.consumed_ranges), "mfu": self.mfu(tokens_per_s),
                  "gpu_mem_peak_gib": self.peak_memory_gib(), "time": time.time(), **self.guard.policy_metrics(),
                  **(eval_fields or {})}
        if isinstance(self.optimizer, ChunkedAdamW):
            # Launches of our AdamW kernel, steps the guard gated off included (a step it cannot take goes through
            # torch's AdamW: this shows which).
            record["adamw_kernel_steps"] = self.optimizer.kernel_steps
        if self.rank == 0:
            self.run_dir.metrics(record)
            self.guard.on_metrics(record)

    def peak_memory_gib(self) -> float | None:
        """Peak GPU memory this worker allocated so far (None on CPU): what decides whether a larger micro-batch fits."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 2**30

    def mfu(self, tokens_per_s: float) -> float | None:
        if self.device.type != "cuda":
            return None
        from orchestration.observability.mfu import compute_mfu, peak_flops_per_s

        peak = peak_flops_per_s(torch.cuda.get_device_name(self.device), self.state.precision)
        return compute_mfu(self.flops_per_token, tokens_per_s / self.world_size, peak) if peak else None

    @property
    def flops_per_token(self) -> float:
        if not hasattr(self, "_flops_per_token"):
            from models.planning import plan_model

            plan = plan_model(self.job.model.name, world_size=self.world_size,
                              seq_len=self.job.data.seq_len, micro_batch=self.plan.micro_batch_size,
                              overrides=dict(self.job.model.overrides))
            self._flops_per_token = plan.flops_per_token
        return self._flops_per_token

    def finish(self, status: str, error: str | None = None) -> None:
        if error is None:
            self.collect_checkpoint()  # a stopped run's last periodic save still finishes and is reported
        if self.rank == 0:
            final = self.state.to_dict()
            final["samples_consumed"] = count_in_ranges(self.state.consumed_ranges)
            final["status"] = status
            if error is not None:
                final["error"] = error
            self.run_dir.write_json(FINAL_STATE_FILE, final)
        self.guard.finish(status)
        if self.under_ray:
            import ray.train

            ray.train.report({"step": self.state.step, "status": status, "done": True})


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker (also callable directly for one process or under torchrun)."""
    for key, value in config.get("env", {}).items():
        os.environ.setdefault(key, str(value))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    trainer = Trainer(config)
    try:
        trainer.start()
        status = trainer.run()
    except RunFailed as exc:
        trainer.abandon_checkpoint()
        trainer.finish("failed", error=str(exc))
        return
    except BaseException:
        trainer.abandon_checkpoint()
        raise
    trainer.finish(status)


