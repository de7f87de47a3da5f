"""The worker loop's divergence check, every step: FP8 health and the detectors -> one agreement -> the policy's
decision, returned to the loop, which applies it (orchestration/training/decisions.py: events, precision switches,
rollback) - the guard itself changes nothing of the model, optimizer or checkpoints.

Pure pieces live in monitor.py (detectors), agreement.py (the one collective) and policy.py (the state machine).
What the guard found reaches the logs through the loop's observer (orchestration/training/observer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from orchestration.config import MonitorConfig
from orchestration.divergence.agreement import StopRequest, agree_and_decide, agree_stop_alone
from orchestration.divergence.monitor import Finding, StepMonitor
from orchestration.divergence.policy import Decision, DivergencePolicy, Proceed


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
        self.last_fp8_health: dict[str, torch.Tensor] | None = None  # of the last check; None while in BF16
        self.eval_gap_max = config.eval_gap_max

    # -- per step -------------------------------------------------------------------------------------------
    def shadow_due(self, step: int) -> bool:
        """Whether this step's check wants the BF16 shadow losses (check's `shadow`)."""
        return self.enabled and self.fp8_run and self.monitor.shadow_due(step, self.policy.precision == "fp8")

    def precision_in_force(self) -> tuple[str, tuple[str, ...] | None]:
        """(the run's precision, the layers a layer-scoped fallback holds in bf16 or None) as the policy decided."""
        return self.policy.precision, self.policy.bf16_layers

    def read_fp8_health(self, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor] | None,
                                                                  dict[str, torch.Tensor] | None]:
        """(the model's FP8 health, the per-unit saturation under fallback_scope=layers) as this step's forwards left
        them, on the device; (None, None) unless the check runs on FP8. Read before any other forward (a shadow
        check's) overwrites them."""
        if not (self.enabled and self.fp8_run and self.policy.precision == "fp8"):
            return None, None
        import fp8

        health = fp8.fp8_health(model)
        layer_health = None
        if self.layer_names:
            layer_health = {name: fp8.fp8_health(model.get_submodule(name))["saturated_frac"]
                            for name in self.layer_names}
        return health, layer_health

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
              fp8_health: tuple[Mapping[str, torch.Tensor] | None, Mapping[str, torch.Tensor] | None] = (None, None),
              shadow: tuple[torch.Tensor, torch.Tensor] | None = None,
              gated_update: Callable[[torch.Tensor], bool] | None = None,
              stop: StopRequest | None = None) -> tuple[Decision, bool]:
        """The agreed decision for `step` (identical on every rank) and whether `gated_update` applied the step's
        update. fp8_health: read_fp8_health's. shadow: (FP8 loss, BF16 loss) of the step's first micro-batch when
        shadow_due(step). gated_update: see orchestration.divergence.agreement.agree_and_decide (the update launched
        before the host read, taking effect only if the decision will apply it); when it did not, the caller applies
        the update itself if the decision says so. stop: a save-and-stop request agreed in the same collective
        (agreement.StopRequest)."""
        if not self.enabled:
            if stop is not None:
                agree_stop_alone(stop, loss.device)
            return Proceed(step), False
        health, layer_health = fp8_health
        # Kept for the dashboards' gauges, read at log steps: without the autograd graph an MoE's expert statistics
        # carry (float() of them warned on every run).
        self.last_fp8_health = {k: v.detach() for k, v in health.items()} if health is not None else None
        verdict = self.monitor.local_verdict(loss, grad_norm, health, shadow, layer_health)
        decision, _, update_applied = agree_and_decide(self.monitor, self.policy, verdict, step,
                                                       gated_update=gated_update, stop=stop)
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

    # -- what the logs show (the loop's observer writes it) ------------------------------------------------
    def policy_metrics(self) -> dict[str, Any]:
        """Decision counters for metrics.jsonl, W&B and Ray (skips, fallbacks, retries, relapses, rollbacks)."""
        return {f"policy_{k}": v for k, v in self.policy.counters().items() if k != "precision"}

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
