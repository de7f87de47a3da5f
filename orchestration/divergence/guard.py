"""The worker loop's side of divergence handling: detectors -> one agreement -> policy -> action, every step.

Pure pieces live in monitor.py (detectors), agreement.py (the one collective) and policy.py (the state machine);
this module applies their decisions to a Trainer: drop the step's update, switch precision with
fp8.set_precision, roll back in-process to the newest good checkpoint, and write every decision as events with its
evidence (on every rank, so a test can see that all ranks acted at the same step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from orchestration.divergence.agreement import agree_and_decide
from orchestration.divergence.monitor import Finding, StepMonitor
from orchestration.divergence.policy import DivergencePolicy, FallbackToBF16, RetryFP8, Rollback, SkipStep, Stop
from orchestration.training.elastic import merge_ranges
from orchestration.training.faults import FaultInjector


def fp8_watch_units(model: torch.nn.Module) -> tuple[str, ...]:
    """The parts of a converted model that fall back one by one under fallback_scope=layers: each transformer
    block, and the output head when it runs in FP8 (precision.fp8_output_head). The head needs its own slot: in the
    model-wide saturation (a mean over every FP8 linear) a head clipping 5% of its logits moves the mean by ~2e-4,
    under the 1e-3 alarm."""
    from fp8.linear import Float8Linear

    units = tuple(f"layers.{name}" for name in model.layers)
    if isinstance(getattr(model, "output", None), Float8Linear):
        units += ("output",)
    return units


class StepGuard:
    def __init__(self, trainer: Any):  # the worker loop's Trainer (not imported: the loop imports this module)
        self.trainer = trainer
        job = trainer.job
        self.enabled = job.monitor.enabled
        self.fp8_run = trainer.recipe is not None
        # Per-block FP8 saturation slots let the policy fall back only the offending blocks (fallback_scope=layers).
        self.layer_names: tuple[str, ...] = ()
        if self.fp8_run and job.monitor.fallback_scope == "layers":
            self.layer_names = fp8_watch_units(trainer.model)
        self.monitor = StepMonitor(job.monitor, self.layer_names)
        self.policy = DivergencePolicy(job.monitor, precision="fp8" if self.fp8_run else "bf16")
        self.faults = FaultInjector(job.faults, rank=trainer.rank, marker_dir=trainer.run_dir.path / "faults")
        self.last_bad_step: int | None = None
        self.wandb = None
        self.ray_metrics = None
        self.last_fp8_health: dict[str, torch.Tensor] | None = None  # of the last check; None while in BF16
        self.check_seconds = 0.0
        self.update_applied = False  # by the last check(), through its gated_update
        if trainer.rank == 0:
            self._start_loggers()

    # -- per step -------------------------------------------------------------------------------------------
    def shadow_losses(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Recompute this rank's first micro-batch in FP8 and in BF16 (no grad) when the shadow check is due."""
        t = self.trainer
        if not (self.enabled and self.fp8_run and self.monitor.shadow_due(t.state.step, self.policy.precision == "fp8")):
            return None
        import fp8

        start, end = t.plan.sample_slice(t.rank, 0)
        inputs, targets = t.dataset.batch(t.state.cursor + start, t.state.cursor + end)
        inputs, targets = inputs.to(t.device), targets.to(t.device)
        with torch.no_grad():
            # FP8 as the run trains now (layers the policy holds in bf16 stay there), against all-bf16.
            loss_fp8 = t.compute_loss(inputs, targets)[0]
            fp8.set_precision(t.model, "bf16")
            loss_bf16 = t.compute_loss(inputs, targets)[0]
        self.apply_policy_precision()
        return loss_fp8, loss_bf16

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor,
              gated_update: Callable[[torch.Tensor], bool] | None = None) -> str:
        """Returns 'proceed' | 'skip' | 'rolled_back' | 'stop'. Identical on every rank (one agreed verdict).

        gated_update: see orchestration.divergence.agreement.agree_and_decide (the step's update launched before the host
        read, taking effect only if the decision will apply it). `self.update_applied` then says whether it did:
        on 'proceed' the caller applies the update itself only if it did not."""
        self.update_applied = False
        if not self.enabled:
            return "proceed"
        t0 = time.perf_counter()
        t = self.trainer
        step = t.state.step
        health, layer_health = None, None
        if self.fp8_run and self.policy.precision == "fp8":
            import fp8

            health = fp8.fp8_health(t.model)
            if self.layer_names:
                layer_health = {name: fp8.fp8_health(t.model.get_submodule(name))["saturated_frac"]
                                for name in self.layer_names}
        self.last_fp8_health = health
        shadow = self.shadow_losses()
        verdict = self.monitor.local_verdict(loss, grad_norm, health, shadow, layer_health)
        decision, _, self.update_applied = agree_and_decide(self.monitor, self.policy, verdict, step,
                                                            gated_update=gated_update)
        self.check_seconds += time.perf_counter() - t0
        if decision.kind == "proceed":
            return "proceed"

        for record in decision.events():
            name = record.pop("event")
            record.pop("step", None)
            t.event(name, all_ranks=True, **record)
        if decision.evidence:
            self.last_bad_step = step
        if isinstance(decision, Stop):
            return "stop"
        if isinstance(decision, RetryFP8):
            self._set_precision("fp8", decision.scope)
            return "proceed"
        if isinstance(decision, FallbackToBF16):
            self._set_precision("bf16", decision.scope)
            return "skip"
        if isinstance(decision, SkipStep):
            t.event("step_skipped", all_ranks=True, reason=",".join(f.detector for f in decision.evidence))
            return "skip"
        if isinstance(decision, Rollback):
            self._rollback(decision)
            return "rolled_back"
        raise AssertionError(f"unhandled decision {decision!r}")

    @property
    def checks_eval_gap(self) -> bool:
        """Whether an evaluation now also evaluates the weights in BF16 for the eval-gap check: monitors on, an FP8
        run, FP8 findings in force (not in a whole-model BF16 cool-down), monitor.eval_gap_max > 0."""
        return (self.enabled and self.fp8_run and self.policy.acts_on_fp8_findings
                and self.trainer.job.monitor.eval_gap_max > 0)

    def check_eval_gap(self, eval_fp8: float, eval_bf16: float) -> None:
        """The policy's decision on one evaluation's relative gap (eval_fp8 - eval_bf16) / eval_bf16, taken between
        steps on every rank (both losses are all-reduced, so every rank decides the same); a fallback is applied at
        once, so training goes on in BF16 from the next step."""
        t = self.trainer
        step, limit = t.state.step, t.job.monitor.eval_gap_max
        gap = (eval_fp8 - eval_bf16) / abs(eval_bf16) if eval_bf16 else float("inf")
        if gap <= limit:  # a NaN gap (a non-finite FP8 evaluation) does not pass
            return
        decision = self.policy.decide_eval_gap(Finding("eval_gap", rank=0, value=gap, threshold=limit, step=step))
        if decision.kind == "proceed":
            return
        t.event("eval_gap_exceeded", all_ranks=True, eval_loss_fp8=eval_fp8, eval_loss_bf16=eval_bf16, rel_gap=gap,
                threshold=limit)
        for record in decision.events():
            name = record.pop("event")
            record.pop("step", None)
            t.event(name, all_ranks=True, **record)
        self.last_bad_step = step
        if isinstance(decision, FallbackToBF16):
            self._set_precision("bf16", decision.scope)

    def _set_precision(self, precision: str, scope: tuple[str, ...] | None) -> None:
        import fp8

        t = self.trainer
        fp8.set_precision(t.model, precision, scope=list(scope) if scope else None)
        if scope is None:
            t.state.precision = precision

    def apply_policy_precision(self) -> None:
        """Put the model in the precision the policy has in force: the run's mode, then the layers a layer-scoped
        fallback holds in bf16 (a whole-model switch alone would silently return them to FP8)."""
        if not self.fp8_run:
            return
        self._set_precision(self.policy.precision, None)
        if self.policy.bf16_layers:
            self._set_precision("bf16", self.policy.bf16_layers)

    def _rollback(self, decision: Rollback) -> None:
        """In-process: reload the newest good checkpoint (resharded if the world size changed), skip the data."""
        t = self.trainer
        # Collective, as at start: every rank must load the same step even if a shared filesystem shows one of them
        # an older manifest (only rank 0 writes the good marks).
        info = t.ckpt.latest(good_only=True, collective=True)
        if info is None:
            raise RuntimeError("rollback requested but no good checkpoint exists (the step-0 one was removed?)")
        bad_end = t.state.cursor + t.job.train.global_batch_size  # the bad step's samples are dropped too
        policy_state = self.policy.state_dict()  # the policy is not rolled back: it bounds the episode
        monitor_state = self.monitor.state_dict()
        extra = t.ckpt.load(info, t.model, t.optimizer, t.scheduler)
        t.restore_extra(extra)
        self.policy.load_state_dict(policy_state)
        self.monitor.load_state_dict(monitor_state)
        self.policy.on_rollback(t.state.step)
        new_cursor = bad_end + decision.skip_samples_window
        skipped = [t.state.cursor, new_cursor]
        t.state.skipped_ranges = merge_ranges(t.state.skipped_ranges + [skipped])
        t.state.cursor = new_cursor
        t.state.lr_scale = decision.lr_scale
        # The precision in force is the policy's, not the checkpoint's (a fallback stays in effect after it).
        self.apply_policy_precision()
        t.optimizer.zero_grad(set_to_none=True)
        if t.rank == 0:
            t.ckpt.discard_newer_than(t.state.step)  # a restart must not resume into the diverged trajectory
        t.ckpt.awaiting_good = {s for s in t.ckpt.awaiting_good if s <= t.state.step}
        t.event("rollback", all_ranks=True, to_step=t.state.step, from_step=decision.bad_step,
                skipped_samples=skipped[1] - skipped[0], skipped_range=skipped, checkpoint=str(info.path),
                lr_scale=decision.lr_scale)
        # Re-save the step with what the rollback decided (data cursor past the bad samples, skipped ranges, lr scale,
        # the policy's counters and precision): a restart before the next periodic save would otherwise resume the
        # checkpoint as it was, replay the skipped samples and forget the rollback (max_rollbacks unbounded).
        t.save_checkpoint(good=True)

    # -- checkpointable state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "monitor": self.monitor.state_dict(),
                "last_bad_step": self.last_bad_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.monitor.load_state_dict(state["monitor"])
        self.last_bad_step = state.get("last_bad_step")
        self.apply_policy_precision()

    # -- loggers (rank 0) -----------------------------------------------------------------------------------
    def _start_loggers(self) -> None:
        t = self.trainer
        job = t.job
        tags = {"model": job.model.name, "precision": job.precision.name, "run": t.run_dir.path.name}
        if job.logging.ray_metrics:
            try:
                from orchestration.observability.ray_metrics import TrainingMetrics

                self.ray_metrics = TrainingMetrics(tags)
            except Exception as exc:  # noqa: BLE001  # outside Ray (torchrun, tests) there is no metrics agent
                print(f"[rank 0] Ray metrics disabled: {exc}", flush=True)
        if job.logging.wandb and job.logging.wandb_mode != "disabled":
            from orchestration.config import to_dict
            from orchestration.observability.wandb_logger import WandbRun, tags_from_config

            config = to_dict(job)  # WandbRun drops secrets itself
            if t.recipe:
                config["precision"]["recipe"] = t.recipe  # the resolved recipe, not "auto"
            self.wandb = WandbRun(t.run_dir.path, config, project=job.logging.project,
                                  group=job.logging.group or job.model.name, tags=tags_from_config(config),
                                  mode=job.logging.wandb_mode)

    def _wandb(self, method: str, *args: Any) -> None:
        """One call into the W&B run; an error there disables W&B for the rest of the run with one message
        instead of stopping training (observability never kills a run; metrics.jsonl and events.jsonl remain)."""
        if self.wandb is None:
            return
        try:
            getattr(self.wandb, method)(*args)
        except Exception as exc:  # noqa: BLE001 - any W&B failure: disable it, keep training
            print(f"[rank 0] W&B logging disabled after an error in {method}: {type(exc).__name__}: {exc}",
                  flush=True)
            self.wandb = None

    def log_event(self, record: dict[str, Any]) -> None:
        self._wandb("log_event", record)
        if self.ray_metrics is not None:
            self.ray_metrics.record_event(record)

    def policy_metrics(self) -> dict[str, Any]:
        """Decision counters for metrics.jsonl, W&B and Ray (skips, fallbacks, retries, relapses, rollbacks)."""
        return {f"policy_{k}": v for k, v in self.policy.counters().items() if k != "precision"}

    def on_metrics(self, record: dict[str, Any]) -> None:
        self._wandb("log_metrics", record["step"], record)
        if self.ray_metrics is not None:
            self.ray_metrics.update(record)
            for name, value in self.fp8_health_gauges().items():
                self.ray_metrics.set(name, value)

    def fp8_health_gauges(self) -> dict[str, float]:
        """FP8 saturation/underflow of the last checked step for the dashboards (read at log steps only: one host
        read of two scalars). 0 while the run is in BF16: no value goes through an FP8 cast then."""
        if not (self.enabled and self.fp8_run):
            return {}
        health = self.last_fp8_health
        if health is None:
            return {"fp8_saturated_frac": 0.0, "fp8_underflow_frac": 0.0}
        return {"fp8_saturated_frac": float(health["saturated_frac"]),
                "fp8_underflow_frac": float(health["underflow_frac"])}

    def finish(self, status: str) -> None:
        self._wandb("finish", {"status": status, **self.policy.counters()})
