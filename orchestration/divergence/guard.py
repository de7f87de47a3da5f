"""The worker loop's divergence check, every step: FP8 health and the detectors -> one agreement -> the policy's
decision, returned to the loop, which applies it (orchestration/training/decisions.py: events, precision switches,
rollback) - the guard itself changes nothing of the model, optimizer or checkpoints.

Pure pieces live in monitor.py (detectors), agreement.py (the one collective) and policy.py (the state machine).
The guard also feeds the decision counters and metrics to W&B and Ray (rank 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orchestration.config import JobConfig, MonitorConfig
from orchestration.divergence.agreement import StopRequest, agree_and_decide, agree_stop_alone
from orchestration.divergence.monitor import Finding, StepMonitor
from orchestration.divergence.policy import Decision, DivergencePolicy, Proceed

log = logging.getLogger(__name__)


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
    def __init__(self, config: MonitorConfig, model: torch.nn.Module, fp8_run: bool):
        self.enabled = config.enabled
        self.fp8_run = fp8_run
        # Per-block FP8 saturation slots let the policy fall back only the offending blocks (fallback_scope=layers).
        self.layer_names: tuple[str, ...] = ()
        if self.fp8_run and config.fallback_scope == "layers":
            self.layer_names = fp8_watch_units(model)
        self.monitor = StepMonitor(config, self.layer_names)
        self.policy = DivergencePolicy(config, precision="fp8" if self.fp8_run else "bf16")
        self.last_bad_step: int | None = None
        self.wandb = None
        self.ray_metrics = None
        self.last_fp8_health: dict[str, torch.Tensor] | None = None  # of the last check; None while in BF16
        self.check_seconds = 0.0
        self.eval_gap_max = config.eval_gap_max

    # -- per step -------------------------------------------------------------------------------------------
    def shadow_due(self, step: int) -> bool:
        """Whether this step's check wants the BF16 shadow losses (check's `shadow`)."""
        return self.enabled and self.fp8_run and self.monitor.shadow_due(step, self.policy.precision == "fp8")

    def precision_in_force(self) -> tuple[str, tuple[str, ...] | None]:
        """(the run's precision, the layers a layer-scoped fallback holds in bf16 or None) as the policy decided."""
        return self.policy.precision, self.policy.bf16_layers

    def check(self, model: torch.nn.Module, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
              gated_update: Callable[[torch.Tensor], bool] | None = None,
              shadow_losses: Callable[[], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
              stop: StopRequest | None = None) -> tuple[Decision, bool]:
        """The agreed decision for `step` (identical on every rank) and whether `gated_update` applied the step's
        update. gated_update: see orchestration.divergence.agreement.agree_and_decide (the update launched before
        the host read, taking effect only if the decision will apply it); when it did not, the caller applies the
        update itself if the decision says so. shadow_losses: () -> (FP8 loss, BF16 loss) or None, called when
        shadow_due(step), after the FP8 health is read (its forwards would overwrite the step's statistics).
        stop: a save-and-stop request agreed in the same collective (agreement.StopRequest)."""
        if not self.enabled:
            if stop is not None:
                agree_stop_alone(stop, loss.device)
            return Proceed(step), False
        t0 = time.perf_counter()
        health, layer_health = None, None
        if self.fp8_run and self.policy.precision == "fp8":
            import fp8

            health = fp8.fp8_health(model)
            if self.layer_names:
                layer_health = {name: fp8.fp8_health(model.get_submodule(name))["saturated_frac"]
                                for name in self.layer_names}
        # Kept for the dashboards' gauges, read at log steps: without the autograd graph an MoE's expert statistics
        # carry (float() of them warned on every run).
        self.last_fp8_health = {k: v.detach() for k, v in health.items()} if health is not None else None
        shadow = shadow_losses() if shadow_losses is not None and self.shadow_due(step) else None
        verdict = self.monitor.local_verdict(loss, grad_norm, health, shadow, layer_health)
        decision, _, update_applied = agree_and_decide(self.monitor, self.policy, verdict, step,
                                                       gated_update=gated_update, stop=stop)
        self.check_seconds += time.perf_counter() - t0
        if decision.evidence:
            self.last_bad_step = step
        return decision, update_applied

    @property
    def checks_eval_gap(self) -> bool:
        """Whether an evaluation now also evaluates the weights in BF16 for the eval-gap check: monitors on, an FP8
        run, FP8 findings in force (not in a whole-model BF16 cool-down), monitor.eval_gap_max > 0."""
        return self.enabled and self.fp8_run and self.policy.acts_on_fp8_findings and self.eval_gap_max > 0

    def check_eval_gap(self, step: int, eval_fp8: float, eval_bf16: float) -> Decision:
        """The policy's decision on one evaluation's relative gap (eval_fp8 - eval_bf16) / eval_bf16, taken between
        steps on every rank (both losses are all-reduced, so every rank decides the same). The loop applies it at
        once (training/decisions.py), so training goes on in BF16 from the next step after a fallback."""
        gap = (eval_fp8 - eval_bf16) / abs(eval_bf16) if eval_bf16 else float("inf")
        if gap <= self.eval_gap_max:  # a NaN gap (a non-finite FP8 evaluation) does not pass
            return Proceed(step)
        decision = self.policy.decide_eval_gap(Finding("eval_gap", rank=0, value=gap, threshold=self.eval_gap_max,
                                                       step=step))
        if decision.kind != "proceed":
            self.last_bad_step = step
        return decision

    # -- checkpointable state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "monitor": self.monitor.state_dict(),
                "last_bad_step": self.last_bad_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.monitor.load_state_dict(state["monitor"])
        self.last_bad_step = state.get("last_bad_step")

    # -- loggers (rank 0) -----------------------------------------------------------------------------------
    def start_loggers(self, job: JobConfig, run_dir: Path, recipe: str | None) -> None:
        """W&B and Ray metrics for this run (rank 0 only)."""
        tags = {"model": job.model.name, "precision": job.precision.name, "run": run_dir.name}
        if job.logging.ray_metrics:
            try:
                from orchestration.observability.ray_metrics import TrainingMetrics

                self.ray_metrics = TrainingMetrics(tags)
            except Exception as exc:  # noqa: BLE001  # outside Ray (torchrun, tests) there is no metrics agent
                log.info("Ray metrics disabled: %s", exc)
        if job.logging.wandb and job.logging.wandb_mode != "disabled":
            from orchestration.config import to_dict
            from orchestration.observability.wandb_logger import WandbRun, tags_from_config

            config = to_dict(job)  # WandbRun drops secrets itself
            if recipe:
                config["precision"]["recipe"] = recipe  # the resolved recipe, not "auto"
            self.wandb = WandbRun(run_dir, config, project=job.logging.project,
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
            log.warning("W&B logging disabled after an error in %s: %s: %s", method, type(exc).__name__, exc)
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
