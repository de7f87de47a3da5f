"""DivergencePolicy: every escalation path on synthetic reports and a fake step counter (no Ray, no clock)."""

import json

import pytest

from orchestration.config import MonitorConfig
from orchestration.divergence.monitor import Finding, MonitorReport
from orchestration.divergence.policy import (
    DivergencePolicy,
    FallbackToBF16,
    Proceed,
    RetryFP8,
    Rollback,
    SkipStep,
    Stop,
)

CLEAN = ()


def nan(step, rank=1):
    return (Finding("nonfinite_loss", rank, 1.0, 0.0, step),)


def spike(step, rank=0):
    return (Finding("loss_spike", rank, 9.0, 3.2, step),)


def sat(step, rank=0, layer=None):
    detector = "fp8_saturation" if layer is None else f"fp8_layer:{layer}"
    return (Finding(detector, rank, 0.05, 1e-3, step),)


def drive(policy, script, start=0, stop=None):
    """script: {step: findings_fn}; every other step is clean. Returns {step: decision} for non-Proceed ones."""
    stop = stop if stop is not None else max(script) + 1
    out = {}
    for step in range(start, stop):
        findings = script[step](step) if step in script else CLEAN
        decision = policy.decide(MonitorReport(step=step, findings=findings), step)
        assert decision.step == step
        if not isinstance(decision, Proceed):
            out[step] = decision
    return out


def cfg(**kw):
    base = {"cooldown_steps": 10, "escalation_window": 5, "relapse_window": 20, "max_relapses": 2,
            "max_rollbacks": 2, "skip_window": 100, "max_skips_per_window": 3}
    base.update(kw)
    return MonitorConfig(**base)


def test_clean_steps_proceed_and_apply():
    policy = DivergencePolicy(cfg())
    assert drive(policy, {}, stop=50) == {}
    assert Proceed(step=0).applies_update and not Proceed(step=0).events()
    assert policy.precision == "fp8" and policy.counters()["skips"] == 0


def test_nan_once_skips_with_evidence_then_proceeds():
    policy = DivergencePolicy(cfg())
    out = drive(policy, {3: nan}, stop=20)
    assert list(out) == [3]
    d = out[3]
    assert isinstance(d, SkipStep) and not d.applies_update
    assert [(f.rank, f.detector, f.value, f.threshold) for f in d.evidence] == [(1, "nonfinite_loss", 1.0, 0.0)]
    events = d.events()
    assert events[0] == {"event": "divergence_detected", "step": 3, "rank": 1, "detector": "nonfinite_loss",
                         "value": 1.0, "threshold": 0.0}
    assert events[1]["event"] == "policy_decision" and events[1]["decision"] == "skip_step"
    assert policy.precision == "fp8" and policy.counters()["skips"] == 1


def test_isolated_bad_steps_far_apart_are_each_skipped():
    policy = DivergencePolicy(cfg(escalation_window=5))
    out = drive(policy, {3: nan, 10: spike, 17: nan}, stop=30)
    assert {s: type(d) for s, d in out.items()} == {3: SkipStep, 10: SkipStep, 17: SkipStep}


def test_repeated_nan_falls_back_then_cooldown_then_retry_fp8():
    policy = DivergencePolicy(cfg(cooldown_steps=10))
    out = drive(policy, {3: nan, 5: nan}, stop=30)
    assert {s: type(d) for s, d in out.items()} == {3: SkipStep, 5: FallbackToBF16, 15: RetryFP8}
    fb = out[5]
    assert fb.scope is None and fb.until_step == 15 and not fb.permanent and not fb.applies_update
    assert any(e["event"] == "precision_changed" and e["to"] == "bf16" and e["scope"] == "model"
               for e in fb.events())
    retry = out[15]
    assert retry.applies_update and retry.scope is None
    assert next(e for e in retry.events() if e["event"] == "precision_changed")["to"] == "fp8"
    assert policy.precision == "fp8" and policy.counters()["fallbacks"] == 1


def test_precision_during_cooldown_is_bf16():
    policy = DivergencePolicy(cfg(cooldown_steps=10))
    drive(policy, {0: nan, 1: spike}, stop=2)
    assert policy.precision == "bf16"
    drive(policy, {}, start=2, stop=11)
    assert policy.precision == "bf16"
    assert isinstance(policy.decide(MonitorReport(step=11), 11), RetryFP8) and policy.precision == "fp8"


def test_fp8_health_finding_falls_back_at_once_and_is_ignored_in_bf16():
    policy = DivergencePolicy(cfg(cooldown_steps=10))
    out = drive(policy, {4: sat, 6: sat, 8: sat}, stop=20)
    # Step 4 falls back; FP8 detectors mean nothing while the whole model runs BF16 (6, 8 proceed); retry at 14.
    assert {s: type(d) for s, d in out.items()} == {4: FallbackToBF16, 14: RetryFP8}


def test_layer_scoped_fallback_and_retry():
    policy = DivergencePolicy(cfg(fallback_scope="layers", cooldown_steps=10))
    out = drive(policy, {4: lambda s: sat(s, layer="layers.3"), 6: lambda s: sat(s, layer="layers.1")}, stop=20)
    assert {s: type(d) for s, d in out.items()} == {4: FallbackToBF16, 6: FallbackToBF16, 16: RetryFP8}
    assert out[4].scope == ("layers.3",) and out[6].scope == ("layers.1", "layers.3")
    assert out[6].events()[-1]["scope"] == ["layers.1", "layers.3"]
    assert out[16].scope == ("layers.1", "layers.3")
    assert policy.precision == "fp8" and policy.bf16_layers is None
    # A finding that names no layer falls back the whole model even with fallback_scope=layers.
    policy = DivergencePolicy(cfg(fallback_scope="layers"))
    assert drive(policy, {0: sat}, stop=1)[0].scope is None and policy.precision == "bf16"


def test_bf16_layers_reported_while_rest_stays_fp8():
    policy = DivergencePolicy(cfg(fallback_scope="layers", cooldown_steps=10))
    drive(policy, {2: lambda s: sat(s, layer="layers.0")}, stop=3)
    assert policy.precision == "fp8" and policy.bf16_layers == ("layers.0",)


def test_spike_persisting_in_bf16_rolls_back_with_data_skip_and_lr_scale():
    policy = DivergencePolicy(cfg(rollback_skip_samples=64, rollback_lr_scale=0.5))
    out = drive(policy, {3: spike, 4: spike, 5: spike}, stop=6)
    assert {s: type(d) for s, d in out.items()} == {3: SkipStep, 4: FallbackToBF16, 5: Rollback}
    rb = out[5]
    assert (rb.to_checkpoint, rb.bad_step, rb.skip_samples_window, rb.lr_scale) == ("last_good", 5, 64, 0.5)
    assert not rb.applies_update and rb.evidence[0].detector == "loss_spike"
    assert policy.counters()["rollbacks"] == 1 and policy.lr_scale == 0.5
    # The worker loop reloads step 2's checkpoint; replayed steps run BF16 until 2 + cooldown, then retry FP8.
    policy.on_rollback(2)
    assert policy.precision == "bf16"
    out = drive(policy, {}, start=2, stop=20)
    assert {s: type(d) for s, d in out.items()} == {12: RetryFP8}


def test_isolated_bad_step_in_bf16_is_skipped_not_rolled_back():
    policy = DivergencePolicy(cfg(escalation_window=5, cooldown_steps=50))
    out = drive(policy, {0: nan, 1: nan, 20: spike, 40: spike}, stop=41)
    assert {s: type(d) for s, d in out.items()} == {0: SkipStep, 1: FallbackToBF16, 20: SkipStep, 40: SkipStep}


def test_relapses_make_the_fallback_permanent():
    policy = DivergencePolicy(cfg(cooldown_steps=10, relapse_window=20, max_relapses=2))
    out = drive(policy, {0: sat, 12: sat, 24: sat, 50: sat}, stop=80)
    kinds = {s: type(d) for s, d in out.items()}
    # 0 fallback, 10 retry, 12 relapse 1, 22 retry, 24 relapse 2 -> permanent: no retry ever, 50 ignored (BF16).
    assert kinds == {0: FallbackToBF16, 10: RetryFP8, 12: FallbackToBF16, 22: RetryFP8, 24: FallbackToBF16}
    assert out[12].until_step == 22 and not out[12].permanent
    assert out[24].permanent and out[24].until_step is None
    assert policy.precision == "bf16" and policy.counters()["relapses"] == 2


def test_fallback_long_after_a_retry_is_not_a_relapse():
    policy = DivergencePolicy(cfg(cooldown_steps=10, relapse_window=20, max_relapses=1))
    out = drive(policy, {0: sat, 40: sat}, stop=60)
    assert {s: type(d) for s, d in out.items()} == {0: FallbackToBF16, 10: RetryFP8, 40: FallbackToBF16,
                                                   50: RetryFP8}
    assert policy.counters()["relapses"] == 0


def test_max_relapses_zero_never_retries():
    policy = DivergencePolicy(cfg(max_relapses=0))
    out = drive(policy, {0: sat}, stop=100)
    assert list(out) == [0] and out[0].permanent


def test_too_many_rollbacks_stop_with_a_clear_reason():
    policy = DivergencePolicy(cfg(max_rollbacks=2, rollback_lr_scale=0.5))
    decisions, step = [], 10
    while len(decisions) < 20:  # a spike that never goes away, whatever data is replayed
        decision = policy.decide(MonitorReport(step=step, findings=spike(step)), step)
        decisions.append(decision)
        if isinstance(decision, Stop):
            break
        if isinstance(decision, Rollback):
            step -= 5
            policy.on_rollback(step)
        else:
            step += 1
    kinds = [d.kind for d in decisions]
    # Episode 1 escalates skip -> fallback -> rollback; later ones start in BF16: skip -> rollback, then stop.
    assert kinds == ["skip_step", "fallback_bf16", "rollback", "skip_step", "rollback", "skip_step", "stop"]
    stop = next(d for d in decisions if isinstance(d, Stop))
    assert "2 rollbacks" in stop.reason and "max_rollbacks=2" in stop.reason and stop.status == "diverged"
    assert not stop.applies_update and policy.stopped
    assert [d.lr_scale for d in decisions if isinstance(d, Rollback)] == [0.5, 0.25]
    # Once stopped, always stopped, even on clean steps.
    assert isinstance(policy.decide(MonitorReport(step=99), 99), Stop)


def test_skip_budget_exhausted_escalates():
    policy = DivergencePolicy(cfg(escalation_window=3, max_skips_per_window=2, skip_window=100, cooldown_steps=200))
    out = drive(policy, {0: nan, 10: nan, 20: nan, 30: nan, 40: nan}, stop=41)
    # 0 and 10 are skipped; 20 finds the budget spent (2 skips in 100 steps) -> fallback; in BF16 30 -> rollback.
    assert {s: type(d) for s, d in out.items()} == {0: SkipStep, 10: SkipStep, 20: FallbackToBF16, 30: Rollback,
                                                   40: Rollback}


def test_bf16_run_skips_then_rolls_back_never_falls_back():
    policy = DivergencePolicy(cfg(), precision="bf16")
    assert policy.precision == "bf16"
    out = drive(policy, {3: nan, 4: nan, 9: sat}, stop=30)
    assert {s: type(d) for s, d in out.items()} == {3: SkipStep, 4: Rollback}
    with pytest.raises(ValueError, match="precision"):
        DivergencePolicy(cfg(), precision="fp16")


def test_checkpoint_good_only_after_clean_steps():
    policy = DivergencePolicy(cfg(good_after_steps=5))
    drive(policy, {}, stop=12)
    assert policy.checkpoint_is_good(5, 10) and not policy.checkpoint_is_good(8, 12)
    drive(policy, {12: nan}, start=12, stop=13)
    # A bad step after a pending checkpoint rules it out for good (the worker asks every step, as documented).
    assert not policy.checkpoint_is_good(10, 16) and not policy.checkpoint_is_good(10, 100)
    assert not policy.checkpoint_is_good(12, 16) and policy.checkpoint_is_good(12, 17)


def test_state_dict_round_trip_mid_cooldown_gives_identical_future():
    script = {3: spike, 4: spike, 30: sat, 33: nan, 34: nan, 35: nan}
    a = DivergencePolicy(cfg(rollback_lr_scale=0.5))
    drive(a, script, stop=8)  # mid cool-down
    state = json.loads(json.dumps(a.state_dict()))
    b = DivergencePolicy(cfg(rollback_lr_scale=0.5))
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict() and b.precision == a.precision == "bf16"
    future_a, future_b = drive(a, script, start=8, stop=60), drive(b, script, start=8, stop=60)
    assert future_a == future_b and len(future_a) >= 3
    with pytest.raises(ValueError, match="unknown policy state"):
        b.load_state_dict({**state, "bogus": 1})
    with pytest.raises(ValueError, match="other precision"):
        DivergencePolicy(cfg(), precision="bf16").load_state_dict(state)


def test_full_escalation_from_detectors_to_stop():
    """End to end on the real detectors: NaN once -> skip; spike twice -> fallback; spike in BF16 -> rollback;
    after the rollback a clean run retries FP8; a spike that never goes away exhausts the rollbacks -> stop."""
    import torch

    from orchestration.divergence.agreement import agree
    from orchestration.divergence.monitor import StepMonitor

    config = cfg(warmup_steps=10, cooldown_steps=10, max_rollbacks=1)
    monitor, policy = StepMonitor(config), DivergencePolicy(config)

    def step_with(step, loss):
        report = monitor.evaluate(agree(monitor.local_verdict(torch.tensor(loss), torch.tensor(1.0))), step)
        return policy.decide(report, step)

    got = []
    for step in range(60):
        loss = 2.0 + 0.01 * (step % 3)
        if step == 15:
            loss = float("nan")
        if step >= 30:
            loss = 50.0  # the spike persists until the rollback
        kind = step_with(step, loss).kind
        if kind != "proceed":
            got.append((step, kind))
        if kind == "rollback":
            break
    assert got == [(15, "skip_step"), (30, "skip_step"), (31, "fallback_bf16"), (32, "rollback")]
    policy.on_rollback(20)  # the worker reloaded the good checkpoint of step 20 and skipped the bad data
    later = [(s, step_with(s, 2.0).kind) for s in range(20, 31)]
    assert [x for x in later if x[1] != "proceed"] == [(30, "retry_fp8")]  # replay in BF16, then FP8 again
    tail = [step_with(s, 80.0).kind for s in range(31, 36)]
    assert tail == ["skip_step", "fallback_bf16", "stop", "stop", "stop"]  # max_rollbacks=1 already used
    assert policy.counters() == {"precision": "bf16", "skips": 3, "fallbacks": 2, "retries": 1, "relapses": 1,
                                 "rollbacks": 1, "lr_scale": 1.0}
