"""agree(): bit-exact max + worst rank in one int64 all-reduce; identity without torch.distributed; 2 real gloo
processes reach the same decision at the same step when only one rank sees the trouble."""

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orchestration.divergence.agreement import (
    RANK_MASK,
    DivergenceGuard,
    StopRequest,
    agree,
    decode_keys,
    encode_keys,
)
from orchestration.divergence.monitor import AgreedVerdict
from tests.spawned import free_port, rank_process_group

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-30, 3.4e38, -3.4e38, float("inf"), float("-inf"), 2.5, -2.5]


def test_keys_round_trip_bit_exact_and_keep_the_order():
    g = torch.Generator().manual_seed(0)
    random = (torch.randn(2000, generator=g) * torch.exp(torch.randn(2000, generator=g) * 20)).tolist()
    values_N = torch.tensor(SPECIAL + random, dtype=torch.float32)
    for rank in (0, 1, 7, RANK_MASK):
        back_N, ranks_N = decode_keys(encode_keys(values_N, rank))
        assert torch.equal(back_N.view(torch.int32), values_N.view(torch.int32))  # bit-exact, -0.0 included
        assert ranks_N.tolist() == [rank] * len(values_N)
    keys_N = encode_keys(values_N, 3)
    order_v = torch.argsort(values_N, stable=True)
    assert torch.equal(values_N[torch.argsort(keys_N, stable=True)], values_N[order_v])
    distinct_N = torch.tensor(SPECIAL[2:] + random, dtype=torch.float32).unique()  # sorted, strictly increasing
    keys_d = encode_keys(distinct_N, 0)
    assert bool((keys_d[1:] > keys_d[:-1]).all())


def test_nan_becomes_inf_and_bad_rank_rejected():
    back, _ = decode_keys(encode_keys(torch.tensor([float("nan"), 1.0]), 0))
    assert back.tolist() == [float("inf"), 1.0]
    with pytest.raises(ValueError, match="RANK_BITS"):
        encode_keys(torch.zeros(2), RANK_MASK + 1)


def test_max_of_keys_gives_max_value_and_lowest_rank_on_ties():
    # What all_reduce(MAX) does, done by hand over 4 "ranks".
    per_rank_RD = torch.tensor([[0.0, 2.0, -1.0, 5.0],
                                [1.0, 2.0, -3.0, 5.0],
                                [0.0, 7.0, -2.0, 5.0],
                                [1.0, 1.0, -1.0, 4.0]])
    keys_RD = torch.stack([encode_keys(per_rank_RD[r], r) for r in range(4)])
    values_D, ranks_D = decode_keys(keys_RD.max(dim=0).values)
    assert values_D.tolist() == [1.0, 7.0, -1.0, 5.0]
    assert ranks_D.tolist() == [1, 2, 0, 0]  # ties -> lowest rank


def test_identity_without_process_group():
    assert not dist.is_initialized()
    agreed = agree(torch.tensor([0.0, 1.0, float("-inf"), 2.5]))
    assert agreed == AgreedVerdict(values=(0.0, 1.0, float("-inf"), 2.5), ranks=(0, 0, 0, 0), world_size=1)
    with pytest.raises(ValueError, match="1-D"):
        agree(torch.zeros(2, 2))




def _worker(rank: int, world: int, port: int, out_dir: str, backend: str = "gloo") -> None:
    """Each rank runs the same detector + policy; only rank 1 sees a NaN at step 25 and a spike at step 40."""
    from orchestration.config import MonitorConfig
    from orchestration.divergence.monitor import StepMonitor
    from orchestration.divergence.policy import DivergencePolicy

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    with rank_process_group(backend, f"tcp://127.0.0.1:{port}", rank, world, timeout=timedelta(seconds=60)):
        config = MonitorConfig(warmup_steps=10)
        guard = DivergenceGuard(StepMonitor(config), DivergencePolicy(config))
        log = []
        # A stand-in for the gated optimizer step (optim.ChunkedAdamW): a device counter that advances by the gate.
        updates = torch.zeros((), device=device)
        # A SIGTERM seen by rank 1 alone at step 30 rides in the same collective: count the collectives.
        stop = StopRequest()
        collectives = []
        real_all_reduce = dist.all_reduce

        def counted_all_reduce(*args, **kwargs):
            collectives.append(1)
            return real_all_reduce(*args, **kwargs)

        dist.all_reduce = counted_all_reduce

        def gated_update(gate):
            updates.add_(gate)
            return True

        for step in range(50):
            loss = 2.0 + 0.01 * rank + 0.005 * (step % 4)  # ranks see different losses
            if rank == 1 and step == 25:
                loss = float("nan")
            if rank == 1 and step == 40:
                loss = 30.0
            grad_norm = 1.0 + 0.1 * rank
            stop.local = rank == 1 and step == 30
            decision, report = guard.check(step, torch.tensor(loss, device=device),
                                           torch.tensor(grad_norm, device=device), gated_update=gated_update,
                                           stop=stop)
            assert guard.update_applied == decision.applies_update
            log.append({"step": step, "kind": decision.kind, "applies": decision.applies_update, "stop": stop.agreed,
                        "updates": updates.item(),
                        "evidence": [[f.rank, f.detector, f.value, f.threshold] for f in decision.evidence],
                        "loss": report.stats["loss"], "grad_norm": report.stats["grad_norm"]})
        # Raw agree(): per-slot max and its rank over 2 ranks, with a tie in the last slot.
        agreed = agree(torch.tensor([float(rank), -float(rank), 3.0 if rank else 5.0, 1.0], device=device))
        dist.all_reduce = real_all_reduce
        result = {"log": log, "collectives": len(collectives), "agreed": [list(agreed.values), list(agreed.ranks), agreed.world_size],
                  "policy": guard.policy.state_dict(), "monitor": guard.monitor.state_dict()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_two_ranks_agree_when_only_rank1_sees_the_fault(tmp_path, backend):
    world = 2
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip("NCCL agreement needs 2 CUDA GPUs")
    mp.start_processes(_worker, args=(world, free_port(), str(tmp_path), backend), nprocs=world, join=True,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world))
    # Same decisions, same evidence, same agreed numbers, same state on both ranks: nobody branches alone.
    assert r0["log"] == r1["log"]
    # Rank 1's stop request reached both ranks at its step, in the step's one all-reduce (50 steps + the raw agree).
    assert [e["step"] for e in r0["log"] if e["stop"]] == [30]
    assert r0["collectives"] == r1["collectives"] == 51
    assert r0["policy"] == r1["policy"] and r0["monitor"] == r1["monitor"]
    decisions = {e["step"]: e for e in r0["log"] if e["kind"] != "proceed"}
    assert sorted(decisions) == [25, 40]
    nan_step = decisions[25]
    assert nan_step["kind"] == "skip_step" and not nan_step["applies"]
    assert nan_step["evidence"] == [[1, "nonfinite_loss", 1.0, 0.0]]
    spike_step = decisions[40]
    assert spike_step["kind"] == "fallback_bf16"  # second bad step within escalation_window=50: escalate
    assert [e[:3] for e in spike_step["evidence"]] == [[1, "loss_spike", 30.0]]
    assert 2.0 < spike_step["evidence"][0][3] < 3.0
    # The agreed loss is the worst rank's (rank 1: 2.01 + ...), the agreed grad norm rank 1's 1.1.
    assert r0["log"][0]["loss"] == pytest.approx(2.01) and r0["log"][0]["grad_norm"] == pytest.approx(1.1)
    # At the NaN step the loss slot falls back to the finite rank 0 value.
    assert r0["log"][25]["loss"] == pytest.approx(2.0 + 0.005)
    # The gated update (launched before each host read) took effect at exactly the steps the policy applied: 48 of 50.
    applied = [sum(e["applies"] for e in r0["log"][: i + 1]) for i in range(len(r0["log"]))]
    assert [e["updates"] for e in r0["log"]] == applied and applied[-1] == 48
    values, ranks, world_size = r0["agreed"]
    assert values == [1.0, 0.0, 5.0, 1.0] and ranks == [1, 0, 0, 0] and world_size == 2
    assert r1["agreed"] == r0["agreed"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_detectors_and_key_packing_never_sync_the_host_on_cuda():
    """Only agree()'s final read may synchronise: building the verdict and packing the keys must not."""
    from orchestration.config import MonitorConfig
    from orchestration.divergence.monitor import StepMonitor

    device = torch.device("cuda")
    mon = StepMonitor(MonitorConfig(shadow_every=1), layer_names=("layers.0",))
    loss, grad_norm = torch.tensor(2.5, device=device), torch.tensor(0.5, device=device)
    health = {k: torch.tensor(v, device=device) for k, v in HEALTH_GPU.items()}
    shadow = (loss * 1.01, loss)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verdict_D = mon.local_verdict(loss, grad_norm, health, shadow, {"layers.0": health["saturated_frac"]})
        values_D, ranks_D = decode_keys(encode_keys(verdict_D, 0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert verdict_D.device.type == "cuda" and torch.equal(values_D, verdict_D) and not ranks_D.any()
    # The gated path (agree_and_decide): the agreement, the device gate and starting the read do not sync either;
    # only result() waits, and then for the copy alone.
    from orchestration.divergence.agreement import agree_on_device

    torch.cuda.set_sync_debug_mode("error")
    try:
        on_device = agree_on_device(verdict_D)
        gate = mon.update_gate(on_device.values_D, consider_fp8=True)
        pending = on_device.start_read(gate)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    agreed, gate_value = pending.result()
    assert agreed.values == agree(verdict_D).values and gate_value == 1.0
    report = mon.evaluate(agree(verdict_D), 0)
    assert report.stats["loss"] == 2.5 and report.stats["shadow_rel_diff"] == pytest.approx(0.01, rel=1e-3)
    assert not report.findings


HEALTH_GPU = {"saturated_frac": 0.0, "underflow_frac": 0.01, "amax_max": 3.0}


def test_agree_and_decide_refuses_a_gate_that_disagrees_and_reports_an_update_it_could_not_gate():
    from orchestration.config import MonitorConfig
    from orchestration.divergence.agreement import agree_and_decide
    from orchestration.divergence.monitor import StepMonitor
    from orchestration.divergence.policy import DivergencePolicy

    config = MonitorConfig(warmup_steps=2)
    monitor, policy = StepMonitor(config), DivergencePolicy(config)
    verdict = lambda loss: monitor.local_verdict(torch.tensor(loss), torch.tensor(1.0))
    gates = []
    # An optimizer that cannot take a gated step (torch's AdamW): nothing applied here, the caller steps.
    decision, _, applied = agree_and_decide(monitor, policy, verdict(2.0), 0,
                                            gated_update=lambda g: gates.append(float(g)) or False)
    assert decision.applies_update and not applied and gates == [1.0]
    decision, _, applied = agree_and_decide(monitor, policy, verdict(float("nan")), 1,
                                            gated_update=lambda g: gates.append(float(g)) or True)
    assert not decision.applies_update and not applied and gates == [1.0, 0.0]
    # A gate that says "apply" for a step the policy skips: the weights may be wrong, so it must not pass silently.
    monitor.update_gate = lambda values_D, consider_fp8: torch.ones(())
    with pytest.raises(RuntimeError, match="disagrees with the policy's decision"):
        agree_and_decide(monitor, policy, verdict(float("inf")), 2, gated_update=lambda g: True)
    # Also where the optimizer could not take the gate: other gated work (the router's bias update) did.
    with pytest.raises(RuntimeError, match="disagrees with the policy's decision"):
        agree_and_decide(monitor, policy, verdict(float("inf")), 3, gated_update=lambda g: False)
