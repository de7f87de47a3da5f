"""Fault plan: each fault hits exactly its (rank, step), does what it says, and fires once (also across restarts)."""

import multiprocessing
import os
import signal

import pytest
import torch
from torch import nn

from orchestration.config import FaultConfig
from orchestration.training.faults import FaultInjector, FaultPlan, InjectedCrash


def test_loss_spike_scales_loss_and_grads_only_at_its_rank_and_step():
    plan = FaultPlan(FaultConfig(kind="loss_spike", rank=1, step=3, magnitude=50.0))
    w = torch.tensor(2.0, requires_grad=True)
    for step in range(6):
        for rank in (0, 1):
            loss = plan.maybe_inject_loss(w * 3.0, step, rank)
            w.grad = None
            loss.backward()
            hit = (rank, step) == (1, 3)
            assert loss.item() == (300.0 if hit else 6.0)
            assert w.grad.item() == (150.0 if hit else 3.0)  # the gradients spike with the loss


def test_default_magnitude_and_all_ranks():
    plan = FaultPlan(FaultConfig(kind="loss_spike", rank=-1, step=0))
    assert [plan.maybe_inject_loss(torch.tensor(1.0), 0, r).item() for r in range(3)] == [100.0] * 3


def test_tensor_fault_fires_for_every_micro_batch_of_its_steps_but_not_on_replay():
    plan = FaultPlan(FaultConfig(kind="loss_spike", rank=0, step=5, num_steps=2, magnitude=10.0))
    one = torch.tensor(1.0)
    seen = []
    for step in [4, 5, 5, 6, 6, 7, 3, 4, 5, 6, 7]:  # two micro-batches on 5 and 6, then a rollback to step 3
        seen.append(plan.maybe_inject_loss(one, step, 0).item())
    assert seen == [1.0, 10.0, 10.0, 10.0, 10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert plan.fired(5, 0) and plan.fired(6, 0) and not plan.fired(7, 0)


def test_nan_grad_hits_one_element_of_the_first_nonempty_grad():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    plan = FaultPlan(FaultConfig(kind="nan_grad", rank=0, step=2))
    for step in range(4):
        model.zero_grad(set_to_none=True)
        model(torch.ones(5, 3)).sum().backward()
        model[0].weight.grad = None  # the first parameter has no grad this time: skipped
        injected = plan.maybe_inject_grads(model, step, rank=0)
        assert not plan.maybe_inject_grads(model, step, rank=1)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        n_nan = sum(int(torch.isnan(g).sum()) for g in grads)
        assert injected == (step == 2) and n_nan == (1 if step == 2 else 0)
        if step == 2:
            assert torch.isnan(model[0].bias.grad[0]) and torch.isfinite(model[0].bias.grad[1:]).all()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert torch.isnan(norm)  # what the non-finite-grad detector then sees


def _e4m3_underflow_frac(x: torch.Tensor) -> float:
    """Tensorwise dynamic scaling: amax -> 448. Fraction of non-zero inputs the cast flushes to zero."""
    scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().max()
    x_fp8 = (x * scale).to(torch.float8_e4m3fn)
    nonzero = x != 0
    return float(((x_fp8.float() == 0) & nonzero).sum() / nonzero.sum())


def test_fp8_overflow_outlier_crushes_the_fp8_range():
    plan = FaultPlan(FaultConfig(kind="fp8_overflow", rank=0, step=1))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert plan.maybe_inject_activation(x, 0, 0) is x
    y = plan.maybe_inject_activation(x, 1, 0)
    assert y.shape == x.shape and y[0, 0].item() == pytest.approx(1e6 * x.abs().max().item(), rel=1e-6)
    assert torch.equal(y.flatten()[1:], x.flatten()[1:])
    y.sum().backward()  # out of place: autograd still flows to the untouched elements
    assert x.grad.flatten()[1:].eq(1).all() and x.grad.flatten()[0] == 0
    assert _e4m3_underflow_frac(x.detach()) < 0.01  # healthy: almost nothing underflows
    assert _e4m3_underflow_frac(y.detach()) > 0.9  # the outlier flushes nearly everything to zero


def test_fp8_overflow_hook_on_a_layer():
    layer = nn.Linear(4, 4)
    step = {"now": 0}
    plan = FaultPlan(FaultConfig(kind="fp8_overflow", rank=0, step=2, magnitude=1e3))
    handle = plan.attach_activation_fault(layer, rank=0, get_step=lambda: step["now"])
    x = torch.ones(2, 4)
    amaxes = []
    for step["now"] in range(4):
        amaxes.append(layer(x).abs().max().item())
    handle.remove()
    assert amaxes[0] == amaxes[1] == amaxes[3] and amaxes[2] > 100 * amaxes[0]


def test_fp8_health_corruption_trips_the_fp8_detectors():
    from orchestration.config import MonitorConfig
    from orchestration.divergence.agreement import agree
    from orchestration.divergence.monitor import StepMonitor

    inj = FaultInjector(FaultConfig(kind="fp8_overflow", rank=1, step=3), rank=1)
    mon = StepMonitor(MonitorConfig(warmup_steps=2))
    health = {"saturated_frac": torch.tensor(0.0), "underflow_frac": torch.tensor(0.0),
              "amax_max": torch.tensor(4.0)}
    found = {}
    for step in range(5):
        h = inj.maybe_corrupt_fp8_health(health, step)
        report = mon.evaluate(agree(mon.local_verdict(torch.tensor(2.0), torch.tensor(1.0), h)), step)
        found[step] = sorted(f.detector for f in report.findings)
    assert found == {0: [], 1: [], 2: [], 3: ["fp8_amax_growth", "fp8_saturation"], 4: []}
    assert inj.maybe_corrupt_fp8_health(None, 3) is None


def _run_crash_fault(kind: str, marker_dir: str) -> None:
    plan = FaultPlan(FaultConfig(kind=kind, rank=1, step=2, marker_dir=marker_dir))
    for step in range(4):
        plan.maybe_crash(step, rank=0)  # other ranks never die
        plan.maybe_crash(step, rank=1)
    os._exit(0)


def test_kill_worker_fires_once_across_restarts(tmp_path):
    ctx = multiprocessing.get_context("fork")
    exit_codes = []
    for _ in range(3):  # the first process dies at step 2; its restarts replay step 2 and live
        proc = ctx.Process(target=_run_crash_fault, args=("kill_worker", str(tmp_path)))
        proc.start()
        proc.join(30)
        exit_codes.append(proc.exitcode)
    assert exit_codes == [-signal.SIGKILL, 0, 0]
    assert [p.name for p in tmp_path.iterdir()] == ["fault_kill_worker_rank1_step2.fired"]


def test_crash_raises_once_across_restarts(tmp_path):
    def restarted_worker():
        plan = FaultInjector(FaultConfig(kind="crash", rank=0, step=1), rank=0, marker_dir=tmp_path)
        for step in range(3):
            plan.maybe_crash(step)
        return "finished"

    with pytest.raises(InjectedCrash, match="step 1 on rank 0"):
        restarted_worker()
    assert restarted_worker() == "finished"  # a new process object (new plan) sees the marker
    assert (tmp_path / "fault_crash_rank0_step1.fired").exists()


def test_markers_also_guard_tensor_faults_across_restarts(tmp_path):
    cfg = FaultConfig(kind="loss_spike", rank=0, step=1, magnitude=2.0, marker_dir=str(tmp_path))
    assert FaultPlan(cfg).maybe_inject_loss(torch.tensor(1.0), 1, 0).item() == 2.0
    assert FaultPlan(cfg).maybe_inject_loss(torch.tensor(1.0), 1, 0).item() == 1.0


def test_none_does_nothing():
    plan = FaultInjector(None, rank=0)
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    for step in range(3):
        assert plan.maybe_corrupt_loss(torch.tensor(1.0), step).item() == 1.0
        assert not plan.maybe_corrupt_grads(model, step)
        plan.maybe_crash(step)
    assert torch.isfinite(model.weight.grad).all()


@pytest.mark.parametrize("kw,match", [({"kind": "bitflip"}, "faults.kind"), ({"rank": -2}, "faults.rank"),
                                      ({"step": -1}, "faults.step"), ({"num_steps": 0}, "faults.num_steps"),
                                      ({"magnitude": -1.0}, "faults.magnitude"),
                                      ({"kind": "crash", "marker_dir": "rel/dir"}, "absolute"),
                                      ({"kind": "kill_worker"}, "marker_dir")])
def test_config_errors_are_actionable(kw, match):
    with pytest.raises(ValueError, match=match):
        FaultPlan(FaultConfig(**kw))
