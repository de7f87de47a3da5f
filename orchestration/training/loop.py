"""The per-worker training loop: a plain function, run by Ray Train workers (or torchrun, or one process in tests).

Per step: grad-accumulated forward/backward over this rank's slice of the global batch, fault hooks, on-device
divergence detectors, ONE all-reduce that agrees on every rank's verdict, the policy's decision (proceed, skip,
fall back to BF16, retry FP8, roll back, stop) taken by all ranks at the same step before optimizer.step(), then
periodic checkpoints that are marked good once the monitors passed the steps after them.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from fp8.linear import Float8Linear
from optim import ChunkedAdamW
from orchestration.data.select import build_datasets
from orchestration.divergence.agreement import StopRequest
from orchestration.divergence.guard import StepGuard
from orchestration.divergence.policy import Decision
from orchestration.observability.events import CONFIG_FILE, FINAL_STATE_FILE, PREEMPT_FILE, STOP_FILE, RunDir
from orchestration.training import departure
from orchestration.training.checkpointing import RunCheckpoints, RunFailed, TrainState
from orchestration.training.compile import compile_enabled
from orchestration.training.decisions import apply_decision, apply_eval_gap_decision, apply_policy_precision
from orchestration.training.distributed import init_distributed
from orchestration.training.elastic import BatchPlan, count_in_ranges, merge_ranges, plan_batch
from orchestration.training.faults import FaultInjector
from orchestration.training.gc_policy import ManagedGc
from orchestration.training.model_setup import build_training_model, fp8_kept_in_bf16, import_hf_weights
from orchestration.training.optimizer import lr_at, make_optimizer, set_learning_rate
from orchestration.training.profiling import PROFILE_DIR, LoopProfiler
from orchestration.training.step import MicroBatch, StepModel, compute_loss, train_step
from orchestration.validation import check_preset_device, from_dict

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
        self.group_id = config.get("group_id") or f"{int(t_setup)}"
        # Set by the Ray driver (orchestration.driver.ray_job); torchrun and in-process tests run without Ray reports.
        self.under_ray = config.get("launcher") == "ray"
        self.plan: BatchPlan = plan_batch(job.train.global_batch_size, job.train.micro_batch_size, self.world_size)
        self.dataset, self.validation = build_datasets(job)
        self.eval_sequences = self.check_validation_set()
        torch.manual_seed(job.train.seed)
        self.fp8_kept_bf16, self.fp8_eligible = fp8_kept_in_bf16(job, on_gpu=self.device.type == "cuda")
        self.model, self.recipe = build_training_model(job, self.world_size, self.device, self.dataset.vocab_size,
                                                       keep_bf16=frozenset(self.fp8_kept_bf16))
        self.compiled = compile_enabled(job, self.device)  # the loss follows the blocks
        self.cuda_graphs = self.compiled and job.model.compile_mode == "reduce-overhead" and self.device.type == "cuda"
        self.optimizer = make_optimizer(job, self.device, self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(s, job))
        self.state = TrainState(precision="fp8" if self.recipe else "bf16")
        self.compute_dtype = _DTYPES[job.precision.compute_dtype]
        self.tokens_per_step = job.train.global_batch_size * job.data.seq_len
        self.checkpoints = RunCheckpoints(self)  # resume, saves, good marks (training/checkpointing.py)
        self.step_model = StepModel(self.model, self.optimizer, self.device, self.compute_dtype, self.compiled,
                                    self.cuda_graphs, self.world_size, job.train.sharding, job.train.grad_clip)
        self.faults = FaultInjector(job.faults, rank=self.rank, marker_dir=self.run_dir.path / "faults")
        self.guard = StepGuard(job.monitor, self.model, fp8_run=self.recipe is not None)
        if self.rank == 0:
            self.guard.start_loggers(job, self.run_dir.path, self.recipe)
        self.stop_requested = False  # agreed by all ranks at a logged step (the driver's Ctrl-C, STOP_FILE)
        # Save and stop at the next step boundary (SIGTERM to this worker, or the driver's PREEMPT_FILE), agreed in the
        # step's one collective (divergence/agreement.py).
        self.preempt = StopRequest()
        self.sigterm_received = False
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
        self.profiler = LoopProfiler(job.train.profile_from_step, job.train.profile_steps, self.run_dir.path,
                                     self.rank, self.device)
        self.setup_s = time.time() - t_setup

    # -- events ---------------------------------------------------------------------------------------------
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
        resumed = self.checkpoints.load_latest()
        if resumed is None and self.job.model.init_from:
            # A fresh start only: a resume (or a Ray restart) loads its checkpoint, whose step 0 holds these weights.
            self.event("weights_imported", **import_hf_weights(self.model, self.job))
        self.event("worker_group_start", world_size=self.world_size, grad_accum=self.plan.grad_accum,
                   micro_batch_size=self.plan.micro_batch_size, backend=self.info.backend,
                   device=str(self.device), group_id=self.group_id, precision=self.state.precision,
                   recipe=self.recipe, adamw=type(self.optimizer).__name__)
        if self.eval_unavailable:
            self.event("eval_unavailable", reason=self.eval_unavailable)
        if self.fp8_eligible:
            self.event("fp8_layers", converted=self.fp8_eligible - len(self.fp8_kept_bf16),
                       eligible=self.fp8_eligible, kept_bf16=self.fp8_kept_bf16)
        if self.eval_reduced:
            self.event("eval_reduced", reason=self.eval_reduced, eval_sequences=self.eval_sequences)
        self.checkpoints.begin(resumed)

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
        # Read as late as possible, just before the agreement: one stat a step on rank 0 for the driver's forwarded
        # SIGTERM (any rank asking is enough).
        self.preempt.local = self.sigterm_received or (self.rank == 0 and (self.run_dir.path / PREEMPT_FILE).exists())
        # A node of the group leaves with notice (training/departure.py).
        self.preempt.local = self.preempt.local or (self.under_ray and departure.notice_info() is not None)
        return self.guard.check(self.model, self.state.step, loss, grad_norm, gated_update, self.shadow_losses,
                                stop=self.preempt)

    def run(self) -> str:
        try:
            with ManagedGc(self.job.train.gc_every_steps) as managed_gc:
                status = self._run_steps(managed_gc)
        except BaseException:
            self.profiler.abandon()
            raise
        self.profile_ended(self.profiler.stop())  # a loop that ended inside the window
        if status in ("completed", "preempted") and self.job.checkpoint.every_steps:
            self.checkpoints.save()
        return status

    def _run_steps(self, managed_gc: ManagedGc) -> str:
        job = self.job
        status = "completed"
        t_last_log, tokens_since_log = time.time(), 0
        # The first step of a worker group is logged too: the driver's first progress line comes when it ends.
        first_step = self.state.step + 1
        while self.state.step < job.train.steps:
            self.profile_ended(self.profiler.before_step(self.state.step))
            t0 = time.time()
            # An injected crash waits for a background save in flight, so that tests know where a restart resumes
            # (tests/test_checkpoint_async.py covers a save cut short: the .tmp- directory is ignored and removed);
            # that save's timing event is not written, and its error, if it failed, replaces the injected crash.
            self.faults.maybe_crash(self.state.step, self.rank, before=self.checkpoints.manager.wait)
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
            set_learning_rate(self.optimizer, job, self.state.step, self.state.lr_scale)
            self.scheduler.last_epoch = self.state.step
            tokens_since_log += self.tokens_per_step
            eval_fields = self.maybe_evaluate()
            if (eval_fields or self.state.step % job.train.log_every == 0
                    or self.state.step in (first_step, job.train.steps)):
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
            if self.preempt.agreed:  # every rank saw it in this step's agreement: the step is whole, save it
                self.event("preempted", sigterm_on_this_rank=self.sigterm_received)
                status = "preempted"
                break
            self.checkpoints.maybe_mark_good()
            every = job.checkpoint.every_steps
            if every and self.state.step % every == 0 and self.state.step < job.train.steps:
                self.checkpoints.save(background=self.checkpoints.async_saves)
            managed_gc.step(self.state.step)
        return status

    def profile_ended(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            self.event("profile", from_step=summary["from_step"], steps=summary["steps"],
                       started_time=summary["started_time"], wall_ms_per_step=summary["wall_ms_per_step"],
                       trace=f"{PROFILE_DIR}/{summary['trace']}",
                       ms_per_step={c: v["ms"] for c, v in summary["breakdown"].items()})

    def check_validation_set(self) -> int:
        """Validation sequences per evaluation: data.eval_sequences, or 0 when train.eval_every=0 or the byte stream
        has no held-out file (a one-file data.source; an event says so). Too few sequences in the held-out data is
        an error naming what to change."""
        job = self.job
        self.eval_unavailable: str | None = None  # why evaluation is off though train.eval_every asks for it
        self.eval_reduced: str | None = None  # why it runs on fewer sequences than data.eval_sequences
        if job.train.eval_every == 0:
            return 0
        if self.validation is None:
            self.eval_unavailable = (f"no held-out data: data.source={job.data.source!r} has no files after the first "
                                     f"data.max_files={job.data.max_files}; point data.source at a directory with more "
                                     "files, or set train.eval_every=0")
            return 0
        capacity = self.validation.validation_capacity()
        if capacity == 0:
            raise ValueError(f"the held-out data holds no sequence of data.seq_len={job.data.seq_len} tokens: point "
                             "data.source at a directory with more files, lower data.seq_len, or set "
                             "train.eval_every=0")
        if capacity < job.data.eval_sequences:
            # A small held-out set is still worth evaluating on: all of it, said once (an event, rank 0's log).
            self.eval_reduced = (f"the held-out data holds {capacity} sequences of data.seq_len={job.data.seq_len} "
                                 f"tokens, fewer than data.eval_sequences={job.data.eval_sequences}: evaluating on "
                                 f"all {capacity}")
            return capacity
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
            self.checkpoints.collect()  # a stopped run's last periodic save still finishes and is reported
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
    restore_sigterm = catch_sigterm(trainer)
    try:
        trainer.start()
        status = trainer.run()
        if status == "preempted" and trainer.under_ray:
            departure.leave_if_a_node_goes(trainer)  # a node's notice: waits for the restart without the node
    except RunFailed as exc:
        trainer.checkpoints.abandon()
        trainer.finish("failed", error=str(exc))
        return
    except BaseException:
        trainer.checkpoints.abandon()
        raise
    finally:
        restore_sigterm()
    trainer.finish(status)


def catch_sigterm(trainer: Trainer) -> Callable[[], None]:
    """SIGTERM (the notice Kubernetes, Slurm and spot reclaimers give; torchrun forwards its own to the workers) asks
    for a checkpoint at the next step boundary, then a stop: the handler only sets a flag, which the next step's
    agreement carries to every rank. A second SIGTERM ends the process at once. Handlers belong to the main thread:
    under Ray Train the loop runs in another one, and the driver forwards its SIGTERM through PREEMPT_FILE. Returns
    the function that puts the previous handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        if trainer.sigterm_received:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        trainer.sigterm_received = True

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, previous)


