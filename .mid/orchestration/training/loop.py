"""The per-worker training loop: a plain function, run by Ray Train workers (or torchrun, or one process in tests).

A Trainer is built once per worker-group lifetime: the context (job, rank, run directory, data), the TrainingState
(model, optimizer, schedule, progress), the divergence guard, the one observer every report goes through, the
checkpoints, and the configured fault attached from outside the step. Then, per step: the step itself
(training/step.py: forward/backward over this rank's micro-batches, the divergence check with ONE all-reduce that
agrees on every rank's verdict, the update it allows), the decision's consequences (training/decisions.py), the
data cursor and LR schedule, evaluation, metrics, and periodic checkpoints that are marked good once the monitors
passed the steps after them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from optim import ChunkedAdamW
from orchestration.data.select import build_datasets
from orchestration.divergence.guard import StepGuard
from orchestration.observability.events import CONFIG_FILE, FINAL_STATE_FILE, STOP_FILE, RunDir
from orchestration.training import departure
from orchestration.training.checkpointing import RunCheckpoints, RunFailed
from orchestration.training.decisions import apply_decision, apply_eval_gap_decision
from orchestration.training.elastic import count_in_ranges, plan_batch
from orchestration.training.evaluation import evaluate, validation_sequences
from orchestration.training.faults import FaultInjector
from orchestration.training.gc_policy import ManagedGc
from orchestration.training.model_setup import build_training_model, import_hf_weights
from orchestration.training.observer import RunObserver
from orchestration.training.optimizer import lr_at, make_optimizer, set_learning_rate
from orchestration.training.process_group import init_distributed
from orchestration.training.profiling import PROFILE_DIR, LoopProfiler
from orchestration.training.state import TrainingState, WorkerContext
from orchestration.training.step import MicroBatch, StepModel, compute_loss, computing_in_bf16, train_step
from orchestration.validation import from_dict

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Trainer:
    """One worker for the length of one worker-group lifetime: built once, then `start`, `run`, `finish`."""

    def __init__(self, config: dict[str, Any]):
        t_setup = time.time()
        dist = init_distributed(config["job"]["cluster"]["device"])  # the driver sends the whole job
        job = from_dict(config["job"], gpu_vendor=dist.gpu_vendor)
        run_dir = RunDir(config["run_dir"], dist.rank)
        dataset, validation = build_datasets(job)
        # under_ray: set by the Ray driver (orchestration.driver.ray_job); torchrun and in-process tests run without
        # Ray reports.
        self.ctx = WorkerContext(job, dist, run_dir, plan_batch(job.train.global_batch_size,
                                                                job.train.micro_batch_size, dist.world_size),
                                 dataset, validation, under_ray=config.get("launcher") == "ray",
                                 group_id=config.get("group_id") or f"{int(t_setup)}")
        self.eval_sequences, self.eval_unavailable, self.eval_reduced = validation_sequences(
            job.data, validation, job.train.eval_every)

        torch.manual_seed(job.train.seed)
        built = build_training_model(job, dist.world_size, dist.device, dataset.vocab_size)
        self.fp8_layers = built.fp8_layers
        model, recipe, compiled = built.model, built.recipe, built.compiled
        optimizer = make_optimizer(job, dist.device, model.parameters())
        step_model = StepModel(model, optimizer, dist.device, _DTYPES[job.precision.compute_dtype], compiled,
                               compiled and job.model.compile_mode == "reduce-overhead" and dist.device.type == "cuda",
                               dist.world_size, job.train.sharding, job.train.grad_clip)
        self.state = TrainingState(step_model, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, job)),
                                   recipe, precision="fp8" if recipe else "bf16")

        self.guard = StepGuard(job.monitor, model, fp8_run=recipe is not None)
        self.observer = RunObserver(run_dir, dist.rank, self.state)
        self.observer.start_loggers(job, recipe)
        self.checkpoints = RunCheckpoints(self.ctx, self.state, self.guard, self.observer)
        self.faults = FaultInjector(job.faults, rank=dist.rank, marker_dir=run_dir.path / "faults")
        self.faults.attach(step_model, lambda: self.state.step)
        self.stop_requested = False  # agreed by all ranks at a logged step (the driver's Ctrl-C, STOP_FILE)
        # agreed in the step's one collective
        self.preempt = departure.PreemptNotice(run_dir.path, dist.rank, config.get("launcher") == "ray")
        self.profiler = LoopProfiler(job.train.profile_from_step, job.train.profile_steps, run_dir.path,
                                     dist.rank, dist.device)
        self.setup_s = time.time() - t_setup

    # -- start / resume -------------------------------------------------------------------------------------
    def start(self) -> None:
        ctx, state = self.ctx, self.state
        if ctx.under_ray and ctx.rank == 0 and not (ctx.run_dir.path / CONFIG_FILE).is_file():
            # The driver wrote config.yaml there before starting the workers: rank 0 not seeing it means another
            # filesystem, where its metrics, events and checkpoints would be invisible to the driver (a completed
            # run reported as interrupted) and lost with the node.
            raise RuntimeError(f"rank 0 does not see the driver's run directory {ctx.run_dir.path}: run_root must be "
                               "on a filesystem shared by the driver and every worker node (set run_root, or "
                               "cluster.storage_path to a shared path such as NFS)")
        check_same_corpus_on_every_rank(ctx)
        resumed = self.checkpoints.load_latest()
        if resumed is None and ctx.job.model.init_from:
            # A fresh start only: a resume (or a Ray restart) loads its checkpoint, whose step 0 holds these weights.
            self.observer.event("weights_imported", **import_hf_weights(state.model, ctx.job))
            state.weights_changed("weights imported")
        self.observer.event("worker_group_start", world_size=ctx.world_size, grad_accum=ctx.plan.grad_accum,
                            micro_batch_size=ctx.plan.micro_batch_size, backend=ctx.dist.backend,
                            device=str(ctx.device), group_id=ctx.group_id, precision=state.precision,
                            recipe=state.recipe, adamw=type(state.optimizer).__name__,
                            layout=state.model.parallel_layout.describe(),
                            layout_notes=list(state.model.parallel_layout.notes))
        if self.eval_unavailable:
            self.observer.event("eval_unavailable", reason=self.eval_unavailable)
        if self.fp8_layers is not None:
            self.observer.event("fp8_layers", converted=self.fp8_layers.converted,
                                eligible=self.fp8_layers.eligible, kept_bf16=self.fp8_layers.kept_bf16)
        if self.eval_reduced:
            self.observer.event("eval_reduced", reason=self.eval_reduced, eval_sequences=self.eval_sequences)
        self.checkpoints.begin(resumed, self.setup_s)

    # -- the steps ------------------------------------------------------------------------------------------
    def run(self) -> str:
        try:
            with ManagedGc(self.ctx.job.train.gc_every_steps) as managed_gc:
                status = self._run_steps(managed_gc)
        except BaseException:
            self.profiler.abandon()
            raise
        self.profile_ended(self.profiler.stop())  # a loop that ended inside the window
        if status in ("completed", "preempted") and self.ctx.job.checkpoint.every_steps:
            self.checkpoints.save()
        return status

    def _run_steps(self, managed_gc: ManagedGc) -> str:
        job, state, checkpoints = self.ctx.job, self.state, self.checkpoints
        t_last_log, steps_since_log = time.time(), 0
        tokens_per_step = job.train.global_batch_size * job.data.seq_len
        # The first step of a worker group is logged too: the driver's first progress line comes when it ends.
        first_step = state.step + 1
        while state.step < job.train.steps:
            self.profile_ended(self.profiler.before_step(state.step))
            t0 = time.time()
            # An injected crash waits for a background save in flight, so that tests know where a restart resumes
            # (tests/test_checkpoint_async.py covers a save cut short: the .tmp- directory is ignored and removed);
            # that save's timing event is not written, and its error, if it failed, replaces the injected crash.
            self.faults.maybe_crash(state.step, before=checkpoints.manager.wait)
            result = train_step(state.step_model, self.micro_batches(), state.step, self.guard, stop=self.preempt)
            action = apply_decision(result.decision, state, self.guard, checkpoints, self.observer, job)
            if action == "stop":
                return "stopped_divergence"
            if action == "rolled_back":
                continue
            state.advance(job.train.global_batch_size, updated=result.updated)
            set_learning_rate(state.optimizer, job, state.step, state.lr_scale)
            state.scheduler.last_epoch = state.step
            steps_since_log += 1
            eval_fields = self.maybe_evaluate()
            if eval_fields or state.step % job.train.log_every == 0 or state.step in (first_step, job.train.steps):
                now = time.time()
                # The eval's seconds are not training time: left out of tokens/s and of the step's time.
                eval_s = eval_fields.get("eval_s", 0.0)
                self.log_metrics(result.weighted_loss, result.weighted_aux, result.grad_norm,
                                 steps_since_log * tokens_per_step / max(now - t_last_log - eval_s, 1e-9),
                                 now - t0 - eval_s, eval_fields, steps=steps_since_log)
                t_last_log, steps_since_log = now, 0
                if self.stop_requested:
                    return "interrupted"
            if self.preempt.agreed:  # every rank saw it in this step's agreement: the step is whole, save it
                self.observer.event("preempted", sigterm_on_this_rank=self.preempt.sigterm_received)
                return "preempted"
            checkpoints.maybe_mark_good()
            every = job.checkpoint.every_steps
            if every and state.step % every == 0 and state.step < job.train.steps:
                checkpoints.save(background=checkpoints.async_saves)
            managed_gc.step(state.step)
        return "completed"

    def micro_batches(self) -> list[MicroBatch]:
        """This rank's micro-batches of the current step, on the device. An empty micro-batch (uneven split) still
        runs a forward on one sample with weight 0, so every rank issues the same FSDP collectives."""
        ctx, base = self.ctx, self.state.cursor
        plan = ctx.plan
        lo, hi = plan.rank_range(ctx.rank)
        batches = []
        for micro in range(plan.grad_accum):
            start, end = plan.sample_slice(ctx.rank, micro)
            n = end - start
            inputs, targets = ctx.dataset.batch(base + (start if n else lo), base + (end if n else lo + 1))
            batches.append(MicroBatch(inputs.to(ctx.device), targets.to(ctx.device), plan.loss_weight(n),
                                      n / (hi - lo)))
        return batches

    def profile_ended(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            self.observer.event("profile", from_step=summary["from_step"], steps=summary["steps"],
                                started_time=summary["started_time"], wall_ms_per_step=summary["wall_ms_per_step"],
                                trace=f"{PROFILE_DIR}/{summary['trace']}",
                                ms_per_step={c: v["ms"] for c, v in summary["breakdown"].items()})

    def maybe_evaluate(self) -> dict[str, Any]:
        """At every train.eval_every-th step and the last one: the held-out loss of the weights as they are now (in
        the precision the run has in force), and its seconds. Collective: every rank gets here at the same step."""
        ctx, state, guard = self.ctx, self.state, self.guard
        job = ctx.job
        due = self.eval_sequences and (state.step % job.train.eval_every == 0 or state.step == job.train.steps)
        if not due:
            return {}
        t0 = time.time()

        def run() -> float:
            return evaluate(state.model, ctx.validation, self.eval_sequences, ctx.plan.micro_batch_size, ctx.rank,
                            ctx.world_size, ctx.device, lambda x, y: compute_loss(state.step_model, x, y)[0])

        fields: dict[str, Any] = {"eval_loss": run()}
        if guard.checks_eval_gap:
            # The same weights on the same sequences in BF16 (monitor.eval_gap_max): the FP8 path's cost in quality.
            with computing_in_bf16(state.model, *guard.precision_in_force()):
                fields["eval_loss_bf16"] = run()
            fields["eval_gap"] = (fields["eval_loss"] - fields["eval_loss_bf16"]) / abs(fields["eval_loss_bf16"])
            apply_eval_gap_decision(guard.check_eval_gap(state.step, fields["eval_loss"], fields["eval_loss_bf16"]),
                                    state, guard, self.observer, fields["eval_loss"], fields["eval_loss_bf16"])
        return {**fields, "eval_s": round(time.time() - t0, 4), "eval_sequences": self.eval_sequences}

    def log_metrics(self, loss: torch.Tensor, aux: torch.Tensor, grad_norm: torch.Tensor, tokens_per_s: float,
                    step_time_s: float, eval_fields: dict[str, Any], *, steps: int) -> None:
        """One metrics.jsonl record, averaged over the ranks; `steps`: the steps since the previous record."""
        ctx, state = self.ctx, self.state
        # The driver's stop request (Ctrl-C) rides on this all-reduce, so every rank sees it at the same step.
        asked = float((ctx.run_dir.path / STOP_FILE).exists())
        # Expert parallelism: the bytes this rank's all-to-alls sent to other ranks since the previous record.
        a2a = getattr(state.model, "expert_all_to_all_bytes", None)
        values = torch.stack([loss.float(), aux.float(), grad_norm.float(), torch.tensor(asked, device=loss.device),
                              torch.tensor(float(a2a.total if a2a else 0), device=loss.device)])
        if ctx.world_size > 1:
            torch.distributed.all_reduce(values)
            values /= ctx.world_size
        loss_v, aux_v, gn_v, stop_v, a2a_v = values.tolist()
        self.stop_requested = stop_v > 0
        record = {"step": state.step, "loss": loss_v, "aux_loss": aux_v,
                  "lr": state.optimizer.param_groups[0]["lr"], "grad_norm": gn_v, "tokens_per_s": tokens_per_s,
                  "step_time_s": step_time_s, "world_size": ctx.world_size, "precision": state.precision,
                  "samples_consumed": count_in_ranges(state.consumed_ranges), "mfu": self.mfu(tokens_per_s),
                  "gpu_mem_peak_gib": peak_memory_gib(ctx.device), "time": time.time(),
                  **self.guard.policy_metrics(), **eval_fields}
        if isinstance(state.optimizer, ChunkedAdamW):
            # Launches of our AdamW kernel, steps the guard gated off included (a step it cannot take goes through
            # torch's AdamW: this shows which).
            record["adamw_kernel_steps"] = state.optimizer.kernel_steps
        if a2a is not None:
            # per rank (mean over ranks) per step, both directions and the backward's; evaluation forwards included
            record["a2a_bytes_per_step"] = a2a_v / max(steps, 1)
            a2a.reset()
        self.observer.metrics(record, gauges=self.guard.fp8_health_gauges)

    def mfu(self, tokens_per_s: float) -> float | None:
        ctx = self.ctx
        if ctx.device.type != "cuda":
            return None
        from orchestration.observability.mfu import compute_mfu, peak_flops_per_s

        peak = peak_flops_per_s(torch.cuda.get_device_name(ctx.device), self.state.precision)
        return compute_mfu(self.flops_per_token, tokens_per_s / ctx.world_size, peak) if peak else None

    @property
    def flops_per_token(self) -> float:
        if not hasattr(self, "_flops_per_token"):
            from models.planning import plan_model

            job = self.ctx.job
            plan = plan_model(job.model.name, world_size=self.ctx.world_size, seq_len=job.data.seq_len,
                              micro_batch=self.ctx.plan.micro_batch_size, overrides=dict(job.model.overrides))
            self._flops_per_token = plan.flops_per_token
        return self._flops_per_token

    def finish(self, status: str, error: str | None = None) -> None:
        ctx, state = self.ctx, self.state
        if error is None:
            self.checkpoints.collect()  # a stopped run's last periodic save still finishes and is reported
        if ctx.rank == 0:
            final = state.progress()
            final["samples_consumed"] = count_in_ranges(state.consumed_ranges)
            final["status"] = status
            if error is not None:
                final["error"] = error
            ctx.run_dir.write_json(FINAL_STATE_FILE, final)
        self.observer.finish({"status": status, **self.guard.policy.counters()})
        if ctx.under_ray:
            import ray.train

            ray.train.report({"step": state.step, "status": status, "done": True})


def check_same_corpus_on_every_rank(ctx: WorkerContext) -> None:
    """Every rank reads its samples from its own copy of data.source; copies that differ (another Python's standard
    library on one node, a stale file) would train ranks on different data without any error."""
    if ctx.world_size <= 1:
        return
    fingerprints: list[Any] = [None] * ctx.world_size
    torch.distributed.all_gather_object(fingerprints, ctx.dataset.fingerprint)
    if len(set(fingerprints)) > 1:
        by_rank = ", ".join(f"rank {r}: {f}" for r, f in enumerate(fingerprints))
        raise ValueError(f"the ranks read different corpora from data.source={ctx.job.data.source!r} "
                         f"({by_rank}): give every node the same files (e.g. a shared path for data.source)")


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak GPU memory this worker allocated so far (None on CPU): what decides whether a larger micro-batch fits."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker (also callable directly for one process or under torchrun)."""
    for key, value in config.get("env", {}).items():
        os.environ.setdefault(key, str(value))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    trainer = Trainer(config)
    restore_sigterm = departure.catch_sigterm(trainer.preempt)
    try:
        trainer.start()
        status = trainer.run()
        if status == "preempted" and trainer.ctx.under_ray:
            # a node's notice: waits for the restart without the node
            departure.leave_if_a_node_goes(trainer.ctx.rank, trainer.preempt.driver_asked(), trainer.checkpoints,
                                           trainer.observer.event)
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
