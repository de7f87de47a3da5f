"""What to do about a bad step: a deterministic state machine returning typed decisions.

Pure: no torch, no Ray, no clock. It sees one agreed MonitorReport per step (identical on every rank), so every
rank computes the same Decision at the same step. Decisions are made before optimizer.step(): when
`decision.applies_update` is False the step's gradients are dropped and the weights stay as they were.

Escalation (a "bad step" is one with findings that matter in the current precision):
- FP8 on:
  - an FP8-health finding (saturation, underflow, amax growth, shadow mismatch) -> FallbackToBF16 at once
    (scope: the offending layers if `fallback_scope='layers'` and the evidence names them, else the model);
  - a non-finite value or a spike -> SkipStep while it is isolated (at most `skips_before_escalation` bad steps
    in `escalation_window` steps, and within the skip budget); repeated -> FallbackToBF16 for `cooldown_steps`.
- BF16 (after a fallback, or a BF16 run): isolated -> SkipStep; repeated (the bad steps that caused the
  fallback still count, so a spike persisting into BF16 escalates at once) -> Rollback to the newest good
  checkpoint, skipping the data up to the bad step (PaLM), optionally with a reduced LR. More than
  `max_rollbacks` rollbacks -> Stop.
- Cool-down over and clean -> RetryFP8. A fallback within `relapse_window` steps of a retry is a relapse; after
  `max_relapses` relapses the fallback is permanent (FallbackToBF16 with until_step=None; max_relapses=0 means
  never retry FP8). Layer-scoped fallbacks cool down and retry the same way, with RetryFP8.scope = the layers.

After acting on a Rollback the worker loop calls `on_rollback(to_step)`. The policy's own state is NOT rolled
back with the model (its counters are what bounds the number of rollbacks); after a restart it is restored with
`load_state_dict` from the latest checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from orchestration.config import MonitorConfig
from orchestration.divergence.monitor import Finding, MonitorReport

__all__ = [
    "Decision",
    "DivergencePolicy",
    "FallbackToBF16",
    "Proceed",
    "RetryFP8",
    "Rollback",
    "SkipStep",
    "Stop",
]

MODE_FP8 = "fp8"
MODE_COOLDOWN = "bf16_cooldown"
MODE_BF16 = "bf16"  # permanent: after max_relapses, or a run that started in BF16


@dataclass(frozen=True)
class Decision:
    """Base of all decisions. `evidence` holds the findings that caused it (empty for Proceed/RetryFP8)."""

    step: int
    evidence: tuple[Finding, ...] = ()
    kind: ClassVar[str] = "decision"
    applies_update: ClassVar[bool] = True
    """Whether the worker loop runs optimizer.step() for this step."""

    def events(self) -> list[dict[str, Any]]:
        """Event-log records for this decision (events.jsonl; the writer adds `time`).

        One `divergence_detected` per finding, then one `policy_decision`; subclasses add e.g.
        `precision_changed`. The `rollback` event needs the checkpoint step and is written by the worker loop.
        """
        records = [finding.as_event() for finding in self.evidence]
        if self.kind != "proceed":
            records.append({"event": "policy_decision", "step": self.step, "decision": self.kind,
                            **self._fields()})
        return records

    def _fields(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Proceed(Decision):
    kind: ClassVar[str] = "proceed"


@dataclass(frozen=True)
class SkipStep(Decision):
    """Drop this step's gradients; the next step proceeds normally (data is consumed, weights unchanged)."""

    kind: ClassVar[str] = "skip_step"
    applies_update: ClassVar[bool] = False


@dataclass(frozen=True)
class FallbackToBF16(Decision):
    """Drop this step's update, then run the `scope` in BF16 until `until_step` (None: for good)."""

    scope: tuple[str, ...] | None = None
    """None = whole model; else module-name prefixes for fp8.set_precision(model, 'bf16', scope)."""
    until_step: int | None = None
    kind: ClassVar[str] = "fallback_bf16"
    applies_update: ClassVar[bool] = False

    @property
    def permanent(self) -> bool:
        return self.until_step is None

    def events(self) -> list[dict[str, Any]]:
        return super().events() + [{"event": "precision_changed", "step": self.step, "from": "fp8", "to": "bf16",
                                    "scope": _scope_str(self.scope)}]

    def _fields(self) -> dict[str, Any]:
        return {"scope": _scope_str(self.scope), "until_step": self.until_step}


@dataclass(frozen=True)
class RetryFP8(Decision):
    """The step is clean and applies; switch `scope` back to FP8 from the next step on."""

    scope: tuple[str, ...] | None = None
    kind: ClassVar[str] = "retry_fp8"

    def events(self) -> list[dict[str, Any]]:
        return super().events() + [{"event": "precision_changed", "step": self.step, "from": "bf16", "to": "fp8",
                                    "scope": _scope_str(self.scope)}]

    def _fields(self) -> dict[str, Any]:
        return {"scope": _scope_str(self.scope)}


@dataclass(frozen=True)
class Rollback(Decision):
    """Drop this step, reload the newest good checkpoint, skip the data that led to the bad step.

    Data: after loading the checkpoint, move the data cursor to the sample index reached at the end of
    `bad_step` (= (bad_step + 1) * global batch) plus `skip_samples_window` samples, so the samples between the
    checkpoint and the spike are not replayed. LR: multiply the schedule by `lr_scale` (cumulative, absolute).
    """

    to_checkpoint: str = "last_good"
    bad_step: int = 0
    skip_samples_window: int = 0
    lr_scale: float = 1.0
    kind: ClassVar[str] = "rollback"
    applies_update: ClassVar[bool] = False

    def _fields(self) -> dict[str, Any]:
        return {"to_checkpoint": self.to_checkpoint, "bad_step": self.bad_step,
                "skip_samples_window": self.skip_samples_window, "lr_scale": self.lr_scale}


@dataclass(frozen=True)
class Stop(Decision):
    """End the run with status 'diverged' (summary.json), saving nothing from this step."""

    reason: str = ""
    status: str = "diverged"
    kind: ClassVar[str] = "stop"
    applies_update: ClassVar[bool] = False

    def _fields(self) -> dict[str, Any]:
        return {"reason": self.reason, "status": self.status}


def _scope_str(scope: tuple[str, ...] | None) -> str | list[str]:
    return "model" if scope is None else list(scope)


@dataclass
class _State:
    mode: str = MODE_FP8
    bf16_scope: list[str] | None = None
    """Layers in BF16 while mode is fp8 (layer-scoped fallback); the whole model when mode is not fp8."""
    cooldown_until: int | None = None
    retry_step: int | None = None
    recent_bad: list[int] = field(default_factory=list)
    recent_skips: list[int] = field(default_factory=list)
    last_bad_step: int | None = None
    skips: int = 0
    fallbacks: int = 0
    retries: int = 0
    relapses: int = 0
    rollbacks: int = 0
    lr_scale: float = 1.0
    stopped: str | None = None


class DivergencePolicy:
    """State machine from agreed MonitorReports to Decisions. See the module docstring for the escalation.

    precision: the run's configured precision, 'fp8' or 'bf16' (a BF16 run never falls back or retries).
    """

    def __init__(self, config: MonitorConfig, precision: str = "fp8") -> None:
        if precision not in ("fp8", "bf16"):
            raise ValueError(f"precision={precision!r}: must be 'fp8' or 'bf16'")
        self.config = config  # validated by the StepMonitor beside it (or the launcher)
        self.fp8_run = precision == "fp8"
        self.s = _State(mode=MODE_FP8 if self.fp8_run else MODE_BF16)

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def precision(self) -> str:
        """Precision of the bulk of the model the worker loop should run now: 'fp8' or 'bf16'."""
        return "fp8" if self.s.mode == MODE_FP8 else "bf16"

    @property
    def bf16_layers(self) -> tuple[str, ...] | None:
        """Layers held in BF16 while the rest runs FP8 (layer-scoped fallback); None if none."""
        if self.s.mode == MODE_FP8 and self.s.bf16_scope:
            return tuple(self.s.bf16_scope)
        return None

    @property
    def lr_scale(self) -> float:
        return self.s.lr_scale

    @property
    def stopped(self) -> bool:
        return self.s.stopped is not None

    @property
    def acts_on_fp8_findings(self) -> bool:
        """Whether decide() counts FP8-kind findings as evidence now (not while the whole model runs BF16)."""
        return self.s.mode == MODE_FP8

    def counters(self) -> dict[str, Any]:
        """For metrics.jsonl / W&B / summary.json."""
        s = self.s
        return {"precision": self.precision, "skips": s.skips, "fallbacks": s.fallbacks, "retries": s.retries,
                "relapses": s.relapses, "rollbacks": s.rollbacks, "lr_scale": s.lr_scale}

    def checkpoint_is_good(self, checkpoint_step: int, now_step: int) -> bool:
        """A checkpoint saved at the end of `checkpoint_step` is good once `good_after_steps` later steps passed
        the monitors with no bad step (DESIGN: checkpoints are marked good only after that)."""
        s = self.s
        clean_since = s.last_bad_step is None or s.last_bad_step <= checkpoint_step
        return clean_since and now_step - checkpoint_step >= self.config.good_after_steps

    # ------------------------------------------------------------------------------------------------ decide
    def decide(self, report: MonitorReport, step: int) -> Decision:
        """The decision for `step` from its agreed report. Call exactly once per step, on every rank."""
        s, cfg = self.s, self.config
        if s.stopped is not None:
            return Stop(step=step, reason=s.stopped)
        fp8_on = self.acts_on_fp8_findings
        # FP8 detectors are meaningless while the whole model runs BF16 (no FP8 casts, no shadow check).
        evidence = tuple(f for f in report.findings if fp8_on or f.kind != "fp8")
        if not evidence:
            cooling = s.mode == MODE_COOLDOWN or (s.mode == MODE_FP8 and bool(s.bf16_scope))
            if cooling and s.cooldown_until is not None and step >= s.cooldown_until:
                return self._retry(step)
            return Proceed(step=step)

        s.last_bad_step = step
        s.recent_bad = [t for t in s.recent_bad if t > step - cfg.escalation_window]
        repeated = len(s.recent_bad) >= cfg.skips_before_escalation
        s.recent_bad.append(step)
        s.recent_skips = [t for t in s.recent_skips if t > step - cfg.skip_window]
        budget_left = len(s.recent_skips) < cfg.max_skips_per_window
        fp8_health_bad = any(f.kind == "fp8" for f in evidence)

        if fp8_on and (fp8_health_bad or repeated or not budget_left):
            return self._fallback(step, evidence)
        if not repeated and budget_left:
            s.skips += 1
            s.recent_skips.append(step)
            return SkipStep(step=step, evidence=evidence)
        return self._rollback(step, evidence)

    def decide_eval_gap(self, finding: Finding) -> Decision:
        """A held-out evaluation between steps found the FP8 path worse than BF16 on the same weights (the finding:
        detector eval_gap, the same on every rank as the losses are all-reduced): a fallback to BF16 like any FP8
        finding, with the same cool-down, retry and relapse rules. Proceed when FP8 findings do not apply now."""
        if self.s.stopped is not None or not self.acts_on_fp8_findings:
            return Proceed(step=finding.step)
        self.s.last_bad_step = finding.step
        return self._fallback(finding.step, (finding,))

    def _fallback(self, step: int, evidence: tuple[Finding, ...]) -> FallbackToBF16:
        s, cfg = self.s, self.config
        if s.retry_step is not None and step - s.retry_step <= cfg.relapse_window:
            s.relapses += 1
        s.fallbacks += 1
        permanent = s.relapses >= cfg.max_relapses
        until = None if permanent else step + cfg.cooldown_steps
        s.cooldown_until = until
        layers = [f.layer for f in evidence if f.layer]
        # The model-wide saturation finding is the aggregate of the per-layer ones: explained by them, it does not
        # force a whole-model fallback. Any other unattributed finding (non-finite, spike, underflow) does.
        unexplained = [f for f in evidence if not f.layer and f.detector != "fp8_saturation"]
        if cfg.fallback_scope == "layers" and layers and not unexplained:
            # Only the FP8 layers named by the evidence go to BF16; the rest of the model stays FP8.
            s.bf16_scope = sorted(set(s.bf16_scope or []) | set(layers))
            s.recent_bad.clear()  # those layers are dealt with; later bad steps count anew
            return FallbackToBF16(step=step, evidence=evidence, scope=tuple(s.bf16_scope), until_step=until)
        s.bf16_scope = None
        s.mode = MODE_BF16 if permanent else MODE_COOLDOWN
        return FallbackToBF16(step=step, evidence=evidence, scope=None, until_step=until)

    def _retry(self, step: int) -> RetryFP8:
        s = self.s
        scope = tuple(s.bf16_scope) if s.mode == MODE_FP8 and s.bf16_scope else None
        s.mode, s.cooldown_until, s.retry_step, s.bf16_scope = MODE_FP8, None, step, None
        s.retries += 1
        return RetryFP8(step=step, scope=scope)

    def _rollback(self, step: int, evidence: tuple[Finding, ...]) -> Decision:
        s, cfg = self.s, self.config
        if s.rollbacks >= cfg.max_rollbacks:
            s.stopped = (f"diverged at step {step}: still bad after {s.rollbacks} rollbacks "
                         f"(monitor.max_rollbacks={cfg.max_rollbacks})")
            return Stop(step=step, evidence=evidence, reason=s.stopped)
        s.rollbacks += 1
        s.lr_scale *= cfg.rollback_lr_scale
        return Rollback(step=step, evidence=evidence, to_checkpoint="last_good", bad_step=step,
                        skip_samples_window=cfg.rollback_skip_samples, lr_scale=s.lr_scale)

    def on_rollback(self, to_step: int) -> None:
        """The worker loop reloaded the checkpoint of `to_step`: re-base the step-relative state on it.

        Counters (rollbacks, relapses, lr_scale) are kept: they bound the episode. A cool-down restarts from
        `to_step` so the replayed steps run in BF16.
        """
        s = self.s
        s.recent_bad.clear()
        s.recent_skips.clear()
        s.last_bad_step = None
        s.retry_step = None
        if s.cooldown_until is not None:
            s.cooldown_until = to_step + self.config.cooldown_steps

    # ----------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """JSON-able; identical on every rank."""
        s = self.s
        return {"mode": s.mode, "bf16_scope": None if s.bf16_scope is None else list(s.bf16_scope),
                "cooldown_until": s.cooldown_until, "retry_step": s.retry_step, "recent_bad": list(s.recent_bad),
                "recent_skips": list(s.recent_skips), "last_bad_step": s.last_bad_step, "skips": s.skips,
                "fallbacks": s.fallbacks, "retries": s.retries, "relapses": s.relapses, "rollbacks": s.rollbacks,
                "lr_scale": s.lr_scale, "stopped": s.stopped, "fp8_run": self.fp8_run}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        known = set(_State.__dataclass_fields__) | {"fp8_run"}
        unknown = set(state) - known
        if unknown:
            raise ValueError(f"unknown policy state keys {sorted(unknown)}; expected a subset of {sorted(known)}")
        if bool(state.get("fp8_run", self.fp8_run)) != self.fp8_run:
            raise ValueError("policy state was saved by a run of the other precision; start a fresh policy or "
                             "resume with the same precision")
        fields = {k: v for k, v in state.items() if k != "fp8_run"}
        for key in ("recent_bad", "recent_skips"):
            if key in fields:
                fields[key] = [int(t) for t in fields[key]]
        if fields.get("bf16_scope") is not None:
            fields["bf16_scope"] = list(fields["bf16_scope"])
        self.s = _State(**{**_State().__dict__, "mode": self.s.mode, **fields})
