"""Divergence detectors: cheap per-worker checks whose verdicts all ranks agree on once per step.

Pure: no torch.distributed here (the collective lives in agreement.py, the decisions in policy.py).

Flow of one training step (the worker loop calls these, in this order, before optimizer.step()):

    verdict_D = monitor.local_verdict(loss=..., grad_norm=..., fp8_health=..., shadow=...)   # on device, no sync
    agreed = agreement.agree(verdict_D, group)               # ONE all-reduce + ONE host read, same on all ranks
    report = monitor.evaluate(agreed, step)                  # host floats: thresholds, baselines, warm-up
    decision = policy.decide(report, step)                   # policy.py; identical on every rank

agreement.agree_and_decide runs the last three, and can put the step's update between the collective and the read:
gated on the device by update_gate (the thresholds evaluate() will apply, known before the step's values), so the
GPU runs the optimizer while the host reads and evaluates instead of idling.

Where the thresholds are applied, and why there:
- On device each rank only MEASURES: the verdict vector holds one raw statistic per slot (a non-finite flag,
  the loss, the grad norm, FP8 saturation/underflow fractions, FP8 amax, the FP8-vs-BF16 shadow difference).
  Building it is a handful of scalar kernels and never reads anything back to the host.
- The agreement reduces it with MAX and carries, per slot, the rank that holds the maximum. After that single
  host read every rank holds bit-identical floats.
- Thresholds, warm-up and the running baselines are then evaluated on the host from those agreed floats. Since
  every rank evaluates the same numbers with the same state, every rank reaches the same findings, and the
  monitor state (baselines) is identical on all ranks: rank 0 can checkpoint it for everybody and it survives
  a change of world size. The baselines track the agreed (worst-rank) loss and grad norm, which is exactly the
  statistic a spike is judged on, so there is no bias between baseline and test value.
- Baselines are updated only from steps that were clean, so a spike never inflates its own baseline, and the
  value tested at step t is compared with a baseline of steps < t.

Baselines are robust EMAs: mean and variance with decay `ema_beta`; after warm-up every update is winsorised
to mean +- `winsor_z` standard deviations so a moderate outlier that stays under the threshold cannot blow up
the variance; a standard-deviation floor keeps a very smooth series from alarming on tiny wiggles. The loss is
tracked linearly; the grad norm and the FP8 amax, which vary multiplicatively, in log space.

Legend: D = number of verdict slots (len(monitor.slot_names)), L = number of watched FP8 layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from orchestration.config import MonitorConfig


@dataclass(frozen=True)
class AgreedVerdict:
    """The verdict every rank agreed on (agreement.agree): per slot the max over ranks and the rank holding it."""

    values: tuple[float, ...]
    ranks: tuple[int, ...]
    world_size: int = 1


# Fixed verdict slots (raw statistics, reduced with MAX over ranks). Per-layer FP8 slots follow them.
SLOT_NONFINITE_LOSS = 0
SLOT_NONFINITE_GRAD = 1
SLOT_LOSS = 2
SLOT_GRAD_NORM = 3
SLOT_FP8_SATURATED = 4
SLOT_FP8_UNDERFLOW = 5
SLOT_FP8_AMAX = 6
SLOT_SHADOW = 7
BASE_SLOTS = ("nonfinite_loss", "nonfinite_grad", "loss", "grad_norm",
              "fp8_saturated_frac", "fp8_underflow_frac", "fp8_amax", "shadow_rel_diff")
LAYER_SLOT_PREFIX = "fp8_layer:"
BASE_DETECTORS = ("nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_norm_spike",
                  "fp8_saturation", "fp8_underflow", "fp8_amax_growth", "shadow_mismatch")
"""The detector of each base slot (BASE_SLOTS order)."""

# Detector names (the `detector` field of events) and the kind the policy escalates on.
DETECTOR_KIND = {
    "nonfinite_loss": "nonfinite",
    "nonfinite_grad": "nonfinite",
    "loss_spike": "spike",
    "grad_norm_spike": "spike",
    "fp8_saturation": "fp8",
    "fp8_underflow": "fp8",
    "fp8_amax_growth": "fp8",
    "shadow_mismatch": "fp8",
    "eval_gap": "fp8",  # held-out eval loss, FP8 vs BF16 (StepGuard.check_eval_gap), outside the per-step slots
}
NOT_MEASURED = float("-inf")
"""Slot value of a statistic this rank did not measure this step (never wins the MAX, never trips)."""


def detector_kind(detector: str) -> str:
    """'nonfinite' | 'spike' | 'fp8' for a detector name (per-layer FP8 detectors are 'fp8')."""
    if detector.startswith(LAYER_SLOT_PREFIX):
        return "fp8"
    return DETECTOR_KIND[detector]


@dataclass(frozen=True)
class Finding:
    """One tripped detector: the evidence of a decision (one `divergence_detected` event)."""

    detector: str
    rank: int
    """Rank holding the worst value (lowest rank on ties)."""
    value: float
    """The statistic, in the units of `threshold` (loss, grad norm, fraction, amax, 1.0 for a flag)."""
    threshold: float
    """The effective threshold the value exceeded (for spikes: mean + z * std of the baseline)."""
    step: int

    @property
    def kind(self) -> str:
        return detector_kind(self.detector)

    @property
    def layer(self) -> str | None:
        """The FP8 layer the finding is attributed to, if any."""
        if self.detector.startswith(LAYER_SLOT_PREFIX):
            return self.detector[len(LAYER_SLOT_PREFIX):]
        return None

    def as_event(self) -> dict[str, Any]:
        """Fields of a `divergence_detected` event (the event log adds `time`)."""
        return {"event": "divergence_detected", "step": self.step, "rank": self.rank, "detector": self.detector,
                "value": _json_float(self.value), "threshold": _json_float(self.threshold)}


@dataclass(frozen=True)
class MonitorReport:
    """The agreed outcome of the detectors for one step (identical on every rank)."""

    step: int
    findings: tuple[Finding, ...] = ()
    stats: dict[str, float] = field(default_factory=dict)
    """Agreed statistics for metrics (worst-rank loss, grad norm, FP8 fractions, baselines); -inf = not measured."""

    @property
    def bad(self) -> bool:
        return bool(self.findings)

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}


def _json_float(x: float) -> float | str:
    # JSON has no inf/nan: write them as strings so events.jsonl stays strict JSON.
    return x if math.isfinite(x) else str(x)


class RobustEMA:
    """Running mean and variance (EMA) with winsorised updates and a std floor. Host floats."""

    def __init__(self, beta: float, winsor_z: float) -> None:
        self.beta = beta
        self.winsor_z = winsor_z
        self.n = 0
        self.mean = 0.0
        self.var = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def update(self, x: float, armed: bool) -> None:
        """Add a clean observation; once `armed` (past warm-up) it is clipped to mean +- winsor_z * std."""
        if not math.isfinite(x):
            return
        if self.n == 0:
            self.mean, self.var, self.n = x, 0.0, 1
            return
        if armed:
            half = self.winsor_z * self.std
            x = min(max(x, self.mean - half), self.mean + half)
        delta = x - self.mean
        self.mean += (1.0 - self.beta) * delta
        self.var = self.beta * (self.var + (1.0 - self.beta) * delta * delta)
        self.n += 1

    def state_dict(self) -> dict[str, float]:
        return {"n": self.n, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.n, self.mean, self.var = int(state["n"]), float(state["mean"]), float(state["var"])


def _scalar_f32(x: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(()).to(device=device, dtype=torch.float32)
    # torch.full is a fill kernel; torch.tensor(x, device=cuda) would be a host-to-device copy.
    return torch.full((), float(x), dtype=torch.float32, device=device)


class StepMonitor:
    """Per-worker detectors (device side) and their agreed evaluation (host side). See the module docstring.

    `layer_names`: optional FP8 layer prefixes watched one by one (fixed for the run, same on every rank); each
    gets a verdict slot holding that layer's saturated fraction, which lets the policy fall back only those
    layers (`fallback_scope='layers'`).
    """

    def __init__(self, config: MonitorConfig, layer_names: Sequence[str] = ()) -> None:
        self.config = config
        self.layer_names = tuple(layer_names)
        self.slot_names = BASE_SLOTS + tuple(LAYER_SLOT_PREFIX + name for name in self.layer_names)
        # The detector each slot trips (Finding.detector), in slot order.
        self.slot_detectors = BASE_DETECTORS + tuple(LAYER_SLOT_PREFIX + name for name in self.layer_names)
        self.loss_baseline = RobustEMA(config.ema_beta, config.winsor_z)
        self.log_grad_baseline = RobustEMA(config.ema_beta, config.winsor_z)
        self.log_amax_baseline = RobustEMA(config.ema_beta, config.winsor_z)
        config.validate()  # a hand-made config (the launcher validated its own); the baselines above hold nothing yet

    @property
    def num_slots(self) -> int:
        return len(self.slot_names)

    def trip_thresholds(self) -> tuple[float, ...]:
        """Per slot, the value above which evaluate() reports a finding this step (inf: it cannot trip). Known
        before the step's values arrive: the baselines behind the spike thresholds change only in evaluate()."""
        cfg = self.config
        base = (0.0, 0.0, _none_to_inf(self._loss_threshold()), _none_to_inf(self._grad_threshold()),
                cfg.fp8_saturated_frac_max, cfg.fp8_underflow_frac_max, _none_to_inf(self._amax_threshold()),
                cfg.shadow_rel_tol)
        return base + (cfg.fp8_saturated_frac_max,) * len(self.layer_names)

    def update_gate(self, values_D: torch.Tensor, consider_fp8: bool) -> torch.Tensor:
        """0-d float32 on values_D's device: 1.0 if evaluate() will find nothing the policy acts on in these agreed
        values (so its decision applies the update), else 0.0. No host sync: the thresholds go to the device in
        one non-blocking copy and are compared in float64 against the float32 values, the comparison evaluate()
        makes on the host (Python floats), so the two cannot disagree. consider_fp8=False: FP8-kind findings do not
        count (DivergencePolicy.acts_on_fp8_findings: the model runs BF16)."""
        inf = float("inf")
        thresholds = [t if consider_fp8 or detector_kind(d) != "fp8" else inf
                      for d, t in zip(self.slot_detectors, self.trip_thresholds())]
        thr_D = torch.tensor(thresholds, dtype=torch.float64)
        if values_D.is_cuda:
            thr_D = thr_D.pin_memory()
        thr_D = thr_D.to(values_D.device, non_blocking=True)
        # ~(v > t), not v <= t: a NaN value never trips on the host either (values_D holds none after agree()).
        return (~(values_D.to(torch.float64) > thr_D).any()).to(torch.float32)

    def shadow_due(self, step: int, fp8_active: bool = True) -> bool:
        """Whether the worker loop should recompute one micro-batch in BF16 at this step."""
        every = self.config.shadow_every
        return fp8_active and every > 0 and step % every == 0

    # ------------------------------------------------------------------------------------------------ device side
    def local_verdict(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None = None,
        fp8_health: Mapping[str, torch.Tensor] | None = None,
        shadow: tuple[torch.Tensor, torch.Tensor] | None = None,
        layer_health: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """This rank's raw statistics as a float32 verdict_D on loss.device. No host sync.

        loss: this rank's loss of the step (scalar tensor, any float dtype).
        grad_norm: total grad norm (scalar tensor); None = not measured.
        fp8_health: fp8.fp8_health(model) (keys saturated_frac, underflow_frac, amax_max); None/{} in BF16.
        shadow: (loss_fp8, loss_bf16) of the same micro-batch when shadow_due(); None otherwise.
        layer_health: {layer_name: saturated fraction} for the watched layers (missing names = not measured).
        """
        device = loss.device
        inf = _scalar_f32(float("inf"), device)
        not_measured = _scalar_f32(NOT_MEASURED, device)

        loss_f = _scalar_f32(loss, device)
        loss_ok = torch.isfinite(loss_f)
        slots = [(~loss_ok).float(), None, torch.where(loss_ok, loss_f, not_measured), None]
        if grad_norm is None:
            slots[SLOT_NONFINITE_GRAD] = torch.zeros((), device=device)
            slots[SLOT_GRAD_NORM] = not_measured
        else:
            g = _scalar_f32(grad_norm, device)
            g_ok = torch.isfinite(g)
            slots[SLOT_NONFINITE_GRAD] = (~g_ok).float()
            slots[SLOT_GRAD_NORM] = torch.where(g_ok, g, not_measured)

        def health(value: torch.Tensor | None) -> torch.Tensor:
            # A NaN health statistic means the FP8 path itself broke: make it trip (inf), never vanish.
            if value is None:
                return not_measured
            v = _scalar_f32(value, device)
            return torch.where(torch.isnan(v), inf, v)

        fp8_health = fp8_health or {}
        slots.append(health(fp8_health.get("saturated_frac")))
        slots.append(health(fp8_health.get("underflow_frac")))
        slots.append(health(fp8_health.get("amax_max")))
        if shadow is None:
            slots.append(not_measured)
        else:
            loss_fp8, loss_bf16 = (_scalar_f32(x, device) for x in shadow)
            rel = (loss_fp8 - loss_bf16).abs() / loss_bf16.abs().clamp_min(1e-6)
            slots.append(torch.where(torch.isfinite(rel), rel, inf))
        layer_health = layer_health or {}
        unknown = set(layer_health) - set(self.layer_names)
        if unknown:
            raise ValueError(f"layer_health names {sorted(unknown)} are not watched; watched: {self.layer_names}")
        for name in self.layer_names:
            slots.append(health(layer_health.get(name)))
        return torch.stack(slots)

    # -------------------------------------------------------------------------------------------------- host side
    def evaluate(self, agreed: AgreedVerdict, step: int) -> MonitorReport:
        """Apply thresholds to the agreed statistics, then update the baselines if the step was clean."""
        values, ranks = agreed.values, agreed.ranks
        if len(values) != self.num_slots:
            raise ValueError(f"agreed verdict has {len(values)} slots, this monitor expects {self.num_slots}: "
                             "every rank must build its StepMonitor with the same layer_names")
        findings: list[Finding] = []
        thresholds = self.trip_thresholds()
        # Slot order, so findings come in it: non-finite flags, spikes, FP8 health, shadow, watched layers.
        for slot, (detector, threshold) in enumerate(zip(self.slot_detectors, thresholds)):
            if values[slot] > threshold:
                findings.append(Finding(detector, int(ranks[slot]), float(values[slot]), float(threshold), step))
        loss, grad, amax = values[SLOT_LOSS], values[SLOT_GRAD_NORM], values[SLOT_FP8_AMAX]

        stats = {name: float(v) for name, v in zip(self.slot_names, values)}
        stats.update(loss_baseline=self.loss_baseline.mean, loss_threshold=thresholds[SLOT_LOSS],
                     grad_norm_threshold=thresholds[SLOT_GRAD_NORM], fp8_amax_threshold=thresholds[SLOT_FP8_AMAX])

        # Baselines learn only from clean signals: never from a step that tripped (a spike must not raise the bar
        # it is judged against), never from values that were not measured.
        tripped = {f.detector for f in findings}
        step_bad = bool(tripped & {"nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_norm_spike"})
        if not step_bad:
            if math.isfinite(loss):
                self.loss_baseline.update(loss, armed=self._armed(self.loss_baseline))
            if math.isfinite(grad) and grad > 0:
                self.log_grad_baseline.update(math.log(grad), armed=self._armed(self.log_grad_baseline))
        if math.isfinite(amax) and amax > 0 and not tripped & {"fp8_amax_growth", "fp8_saturation"}:
            self.log_amax_baseline.update(math.log(amax), armed=self._armed(self.log_amax_baseline))
        return MonitorReport(step=step, findings=tuple(findings), stats=stats)

    def _armed(self, baseline: RobustEMA) -> bool:
        return baseline.n >= max(self.config.warmup_steps, 1)

    def _loss_threshold(self) -> float | None:
        b = self.loss_baseline
        if not self._armed(b):
            return None
        cfg = self.config
        std = max(b.std, cfg.loss_std_floor_rel * abs(b.mean), cfg.loss_std_floor_abs)
        return b.mean + cfg.loss_spike_z * std

    def _grad_threshold(self) -> float | None:
        b = self.log_grad_baseline
        if not self._armed(b):
            return None
        cfg = self.config
        return math.exp(b.mean + cfg.grad_norm_spike_z * max(b.std, cfg.grad_norm_log_std_floor))

    def _amax_threshold(self) -> float | None:
        b = self.log_amax_baseline
        if not self._armed(b):
            return None
        return math.exp(b.mean) * self.config.fp8_amax_growth_max

    # ------------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain floats (JSON-able); identical on every rank, so rank 0 may save it for all."""
        return {"loss": self.loss_baseline.state_dict(), "log_grad_norm": self.log_grad_baseline.state_dict(),
                "log_fp8_amax": self.log_amax_baseline.state_dict(), "layer_names": list(self.layer_names),
                "config": asdict(self.config)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the baselines (the config of the new run wins; the watched layers must match)."""
        if tuple(state.get("layer_names", ())) != self.layer_names:
            raise ValueError(f"monitor state watches layers {state.get('layer_names')}, this run {self.layer_names}")
        self.loss_baseline.load_state_dict(state["loss"])
        self.log_grad_baseline.load_state_dict(state["log_grad_norm"])
        self.log_amax_baseline.load_state_dict(state["log_fp8_amax"])


def _none_to_inf(x: float | None) -> float:
    return float("inf") if x is None else x
