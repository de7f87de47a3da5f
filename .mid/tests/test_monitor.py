"""Detectors on synthetic series: spikes caught at the right step with their evidence, noise and trends not."""

import json
import math

import pytest
import torch

from orchestration.divergence.agreement import agree
from orchestration.divergence.monitor import (
    BASE_SLOTS,
    NOT_MEASURED,
    SLOT_FP8_AMAX,
    SLOT_GRAD_NORM,
    SLOT_LOSS,
    AgreedVerdict,
    MonitorConfig,
    StepMonitor,
)

HEALTHY = {"saturated_frac": 0.0, "underflow_frac": 1e-4, "amax_max": 10.0}


def run_step(mon, step, loss, grad_norm=None, health=None, shadow=None, layer_health=None):
    t = lambda x: torch.tensor(x, dtype=torch.float32)
    verdict_D = mon.local_verdict(
        t(loss), None if grad_norm is None else t(grad_norm),
        None if health is None else {k: t(v) for k, v in health.items()},
        None if shadow is None else (t(shadow[0]), t(shadow[1])),
        None if layer_health is None else {k: t(v) for k, v in layer_health.items()})
    return mon.evaluate(agree(verdict_D), step)  # torch.distributed not initialised: agree is the identity


def series(n, seed, start=3.0, slope=-2e-3, noise=0.02):
    g = torch.Generator().manual_seed(seed)
    return [start + slope * i + noise * float(torch.randn((), generator=g)) for i in range(n)]


def grad_series(n, seed, base=1.5, log_sigma=0.1):
    g = torch.Generator().manual_seed(seed)
    return [base * math.exp(log_sigma * float(torch.randn((), generator=g))) for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_and_downward_trend_raise_nothing(seed):
    mon = StepMonitor(MonitorConfig())
    losses, grads = series(400, seed), grad_series(400, seed + 100)
    for step, (loss, gn) in enumerate(zip(losses, grads)):
        report = run_step(mon, step, loss, gn, HEALTHY)
        assert not report.findings, (step, report.findings)
    # The loss EMA of a linear trend lags it by slope * beta / (1 - beta) = 0.098 (the noise averages out).
    trend_last = 3.0 - 2e-3 * 399
    assert abs(mon.loss_baseline.mean - (trend_last + 2e-3 * 0.98 / 0.02)) < 0.02
    assert abs(math.exp(mon.log_grad_baseline.mean) - 1.5) < 0.15


def test_loss_spike_caught_at_its_step_with_evidence_and_baseline_unharmed():
    cfg = MonitorConfig()
    mon = StepMonitor(cfg)
    losses = series(300, seed=3)
    losses[150] += 1.0  # one spike
    flagged = []
    for step, loss in enumerate(losses):
        report = run_step(mon, step, loss)
        if step == 149:
            before = dict(mon.loss_baseline.state_dict())
        if step == 150:
            assert dict(mon.loss_baseline.state_dict()) == before  # the spike did not feed the baseline
        flagged += [(step, f) for f in report.findings]
    assert [s for s, _ in flagged] == [150]
    finding = flagged[0][1]
    assert finding.detector == "loss_spike" and finding.kind == "spike" and finding.rank == 0
    assert finding.value == pytest.approx(losses[150], rel=1e-6)
    # threshold = mean + z * max(std, 1% of mean): about 2.7 + 6 * 0.027
    assert losses[150] - 1.0 < finding.threshold < losses[150]
    assert finding.threshold == pytest.approx(before["mean"] + 6 * max(math.sqrt(before["var"]),
                                                                       0.01 * before["mean"]), rel=1e-9)
    event = finding.as_event()
    assert event["event"] == "divergence_detected" and event["detector"] == "loss_spike" and event["step"] == 150
    json.dumps(event)


def test_moderate_rise_below_threshold_is_not_a_spike_but_a_large_one_is():
    mon = StepMonitor(MonitorConfig())
    for step, loss in enumerate(series(100, seed=4, slope=0.0)):
        run_step(mon, step, loss)
    thr = mon._loss_threshold()
    assert not run_step(mon, 100, thr * 0.999).findings
    assert [f.detector for f in run_step(mon, 101, thr * 1.05).findings] == ["loss_spike"]


def test_warmup_disarms_spike_detection():
    mon = StepMonitor(MonitorConfig(warmup_steps=20))
    losses = series(40, seed=5)
    losses[10] *= 10  # inside warm-up: not a finding
    losses[30] *= 10  # after warm-up: a finding
    flagged = [step for step, loss in enumerate(losses) for _ in run_step(mon, step, loss).findings]
    assert flagged == [30]


def test_nonfinite_loss_and_grad_caught_from_step_zero_and_never_enter_baselines():
    mon = StepMonitor(MonitorConfig())
    report = run_step(mon, 0, float("nan"), 1.0)
    assert [(f.detector, f.value, f.threshold) for f in report.findings] == [("nonfinite_loss", 1.0, 0.0)]
    assert report.stats["loss"] == NOT_MEASURED
    assert mon.loss_baseline.n == 0 and mon.log_grad_baseline.n == 0
    report = run_step(mon, 1, 2.0, float("inf"))
    assert [f.detector for f in report.findings] == ["nonfinite_grad"]
    assert mon.loss_baseline.n == 0  # a step with a bad gradient teaches nothing
    report = run_step(mon, 2, float("-inf"), float("nan"))
    assert sorted(f.detector for f in report.findings) == ["nonfinite_grad", "nonfinite_loss"]
    assert not run_step(mon, 3, 2.0, 1.0).findings and mon.loss_baseline.n == 1


def test_grad_norm_spike_caught_lognormal_noise_not():
    mon = StepMonitor(MonitorConfig())
    grads = grad_series(200, seed=6)
    grads[120] *= 10
    flagged = [(step, f) for step, gn in enumerate(grads) for f in run_step(mon, step, 2.0, gn).findings]
    assert [(s, f.detector) for s, f in flagged] == [(120, "grad_norm_spike")]
    assert flagged[0][1].value == pytest.approx(grads[120], rel=1e-6)
    assert 1.5 * math.exp(0.6) * 0.8 < flagged[0][1].threshold < grads[120]  # floor 0.1 in log space, z = 6


def test_fp8_saturation_underflow_and_shadow_thresholds():
    cfg = MonitorConfig()
    mon = StepMonitor(cfg)
    ok = run_step(mon, 0, 2.0, 1.0, {"saturated_frac": 0.9e-3, "underflow_frac": 0.09, "amax_max": 5.0},
                  shadow=(2.0, 2.0 * 1.04))
    assert not ok.findings
    bad = run_step(mon, 1, 2.0, 1.0, {"saturated_frac": 0.02, "underflow_frac": 0.5, "amax_max": 5.0},
                   shadow=(2.5, 2.0))
    got = {f.detector: (f.value, f.threshold, f.kind) for f in bad.findings}
    assert got["fp8_saturation"] == (pytest.approx(0.02), cfg.fp8_saturated_frac_max, "fp8")
    assert got["fp8_underflow"] == (pytest.approx(0.5), cfg.fp8_underflow_frac_max, "fp8")
    assert got["shadow_mismatch"] == (pytest.approx(0.25), cfg.shadow_rel_tol, "fp8")
    assert set(got) == {"fp8_saturation", "fp8_underflow", "shadow_mismatch"}
    # A NaN health statistic means the FP8 path broke: it trips instead of vanishing.
    nan = run_step(mon, 2, 2.0, 1.0, {"saturated_frac": float("nan"), "underflow_frac": 0.0, "amax_max": 5.0})
    assert [(f.detector, f.value) for f in nan.findings] == [("fp8_saturation", float("inf"))]


def test_fp8_amax_growth_after_warmup():
    mon = StepMonitor(MonitorConfig(warmup_steps=10, fp8_amax_growth_max=16.0))
    for step in range(30):
        health = {"saturated_frac": 0.0, "underflow_frac": 0.0, "amax_max": 4.0 * (1.0 + 0.01 * (step % 3))}
        assert not run_step(mon, step, 2.0, 1.0, health).findings
    thr = mon._amax_threshold()
    assert thr == pytest.approx(16.0 * 4.04, rel=0.01)
    report = run_step(mon, 30, 2.0, 1.0, {"saturated_frac": 0.0, "underflow_frac": 0.0, "amax_max": 4e6})
    assert [(f.detector, f.value) for f in report.findings] == [("fp8_amax_growth", 4e6)]
    assert mon._amax_threshold() == thr  # the outlier did not feed the baseline
    # BF16 steps (no health) neither trip nor move the baseline.
    assert not run_step(mon, 31, 2.0, 1.0, None).findings and mon._amax_threshold() == thr


def test_layer_slots_name_the_offending_layer():
    mon = StepMonitor(MonitorConfig(), layer_names=("layers.0", "layers.1"))
    assert mon.num_slots == len(BASE_SLOTS) + 2
    report = run_step(mon, 0, 2.0, 1.0, HEALTHY, layer_health={"layers.0": 0.0, "layers.1": 0.3})
    assert [(f.detector, f.layer, f.kind) for f in report.findings] == [("fp8_layer:layers.1", "layers.1", "fp8")]
    with pytest.raises(ValueError, match="not watched"):
        run_step(mon, 1, 2.0, 1.0, layer_health={"layers.7": 0.0})


def test_local_verdict_is_one_float32_vector_of_raw_statistics():
    mon = StepMonitor(MonitorConfig())
    verdict_D = mon.local_verdict(torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor(0.75),
                                  {"saturated_frac": torch.tensor(0.0), "underflow_frac": torch.tensor(0.01),
                                   "amax_max": torch.tensor(3.0)})
    assert verdict_D.dtype == torch.float32 and verdict_D.shape == (len(BASE_SLOTS),)
    expected = [0.0, 0.0, 2.5, 0.75, 0.0, 0.01, 3.0, NOT_MEASURED]
    assert verdict_D.tolist() == pytest.approx(expected)
    assert verdict_D[SLOT_LOSS].item() == 2.5 and verdict_D[SLOT_GRAD_NORM].item() == 0.75
    assert verdict_D[SLOT_FP8_AMAX].item() == 3.0


def test_evaluate_uses_the_agreed_worst_rank():
    mon = StepMonitor(MonitorConfig())
    values = [1.0, 0.0, 2.0, 1.0, 0.0, 0.0, 1.0, NOT_MEASURED]
    report = mon.evaluate(AgreedVerdict(values=tuple(values), ranks=(3, 0, 5, 0, 0, 0, 0, 0), world_size=8), 7)
    assert [(f.detector, f.rank, f.step) for f in report.findings] == [("nonfinite_loss", 3, 7)]
    with pytest.raises(ValueError, match="slots"):
        mon.evaluate(AgreedVerdict(values=(0.0,), ranks=(0,)), 8)


def test_shadow_schedule():
    mon = StepMonitor(MonitorConfig(shadow_every=5))
    assert [s for s in range(12) if mon.shadow_due(s)] == [0, 5, 10]
    assert not mon.shadow_due(5, fp8_active=False)
    assert not StepMonitor(MonitorConfig()).shadow_due(0)


def test_state_dict_round_trip_continues_identically():
    a = StepMonitor(MonitorConfig())
    losses, grads = series(120, seed=7), grad_series(120, seed=8)
    for step in range(100):
        run_step(a, step, losses[step], grads[step], HEALTHY)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-able
    b = StepMonitor(MonitorConfig())
    b.load_state_dict(state)
    losses[110] += 2.0
    for step in range(100, 120):
        ra = run_step(a, step, losses[step], grads[step], HEALTHY)
        rb = run_step(b, step, losses[step], grads[step], HEALTHY)
        assert ra == rb
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="watches layers"):
        StepMonitor(MonitorConfig(), layer_names=("x",)).load_state_dict(state)


@pytest.mark.parametrize("key,value", [("ema_beta", 1.0), ("fallback_scope", "experts"), ("warmup_steps", -1),
                                       ("fp8_saturated_frac_max", 2.0), ("rollback_lr_scale", 0.0),
                                       ("cooldown_steps", 0)])
def test_config_validation_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"monitor.{key}"):
        StepMonitor(MonitorConfig(**{key: value}))


@pytest.mark.parametrize("consider_fp8", [True, False])
def test_update_gate_is_the_decision_evaluate_reaches_at_every_threshold(consider_fp8):
    """The device gate (launched with the optimizer step before the host read) must equal "evaluate() finds nothing
    the policy acts on" for every slot, at, just below and just above each threshold, armed or not."""
    import copy

    from orchestration.divergence.monitor import detector_kind

    mon = StepMonitor(MonitorConfig(warmup_steps=5, shadow_every=1), layer_names=("layers.0", "output"))
    unarmed = copy.deepcopy(mon)
    for step, (loss, g) in enumerate(zip(series(30, 0), grad_series(30, 0))):
        run_step(mon, step, loss, g, HEALTHY, shadow=(loss, loss), layer_health={"layers.0": 0.0, "output": 0.0})
    clean = [0.0, 0.0, 2.95, 1.5, 0.0, 1e-4, 10.0, 0.0, 0.0, 0.0]
    outcomes = set()
    for monitor in (unarmed, mon):
        thresholds = monitor.trip_thresholds()
        assert len(thresholds) == monitor.num_slots == len(clean)
        candidates = [clean]
        for slot, thr in enumerate(thresholds):
            t32 = torch.tensor(thr, dtype=torch.float32)
            near = [t32, torch.nextafter(t32, torch.tensor(math.inf)), torch.nextafter(t32, torch.tensor(-math.inf))]
            for v in [float(x) for x in near] + [math.inf, NOT_MEASURED, 1.0]:
                values = list(clean)
                values[slot] = v
                candidates.append(values)
        for values in candidates:
            values_D = torch.tensor(values, dtype=torch.float32)
            gate = float(monitor.update_gate(values_D, consider_fp8))
            report = copy.deepcopy(monitor).evaluate(
                AgreedVerdict(values=tuple(values_D.double().tolist()), ranks=(0,) * len(values)), 0)
            acted_on = [f for f in report.findings if consider_fp8 or detector_kind(f.detector) != "fp8"]
            assert gate == (0.0 if acted_on else 1.0), (values, report.findings)
            outcomes.add((gate, bool(report.findings)))
    # Both outcomes seen, and (without FP8 evidence counted) findings that do not close the gate.
    assert {(1.0, False), (0.0, True)} <= outcomes
    assert ((1.0, True) in outcomes) == (not consider_fp8)
