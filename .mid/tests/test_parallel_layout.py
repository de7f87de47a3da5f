"""The parallel layout a world size runs (HSDP shard groups, expert parallelism), the config checks around it, and the
planner's choice of layout for a cluster. Pure functions: no processes."""

from __future__ import annotations

import dataclasses

import pytest

from orchestration.config import ConfigError
from orchestration.training.elastic import plan_layout
from tests.test_config import compose_job


@pytest.mark.parametrize("world, sharding, group, ep, experts, expected", [
    # as configured where the world size allows it
    (8, "fsdp", None, 4, 64, ("fsdp", 8, 4)),
    (16, "hsdp", 8, 8, 64, ("hsdp", 8, 8)),
    # a shrink to 6: EP 4 -> 2 (the largest divisor of gcd(6, 64) <= 4), shard group 4 -> 3
    (6, "fsdp", None, 4, 64, ("fsdp", 6, 2)),
    (6, "hsdp", 4, 4, 64, ("hsdp", 3, 2)),
    # a grow past the configured degrees keeps them
    (32, "hsdp", 8, 4, 64, ("hsdp", 8, 4)),
    # an odd world size loses expert parallelism (64 experts), a prime one HSDP
    (5, "hsdp", 4, 4, 64, ("hsdp", 1, 1)),
    (12, "fsdp", None, 8, 64, ("fsdp", 12, 4)),
    # 160 experts (DeepSeek-V2 style): EP 8 at 40 GPUs, EP 5 at 15
    (40, "fsdp", None, 8, 160, ("fsdp", 40, 8)),
    (15, "fsdp", None, 8, 160, ("fsdp", 15, 5)),
    # hsdp with no group size and no node size: one group (FSDP's sharding)
    (4, "hsdp", None, 1, 0, ("hsdp", 4, 1)),
    (1, "fsdp", None, 4, 64, ("none", 1, 1)),
])
def test_a_world_size_gets_the_closest_layout_it_allows(world, sharding, group, ep, experts, expected):
    layout = plan_layout(world, sharding, group, ep, experts)
    assert (layout.sharding, layout.shard_group_size, layout.expert_parallel) == expected
    assert world % layout.shard_group_size == 0 and world % layout.expert_parallel == 0
    assert experts == 0 or experts % layout.expert_parallel == 0
    lowered = layout.expert_parallel != ep or (sharding == "hsdp" and group and world > 1 and
                                               layout.shard_group_size != group)
    assert bool(layout.notes) == bool(lowered), layout.notes


def test_a_shrink_to_one_worker_says_why_expert_parallelism_went():
    """The layout an elastic run logs at world size 1 (tests/test_elastic_e2e.py shrinks an EP 2 run to it)."""
    layout = plan_layout(1, "fsdp", None, 2, 8)
    assert (layout.expert_parallel, layout.describe()) == (1, "one worker")
    assert layout.notes == ("expert parallelism 2 lowered to 1 (one worker holds all the routed experts)",)
    assert plan_layout(1, "fsdp", None, 1, 8).notes == ()


def test_hsdp_group_defaults_to_the_gpus_of_a_node():
    layout = plan_layout(32, "hsdp", None, 1, 0, gpus_per_node=8)
    assert (layout.replicas, layout.shard_group_size) == (4, 8) and layout.describe() == "HSDP 4 x 8"


def test_expert_parallelism_needs_experts_and_sharding():
    with pytest.raises(ValueError, match="routed experts"):
        plan_layout(4, "fsdp", None, 2, 0)
    with pytest.raises(ValueError, match="train.sharding=fsdp or hsdp"):
        plan_layout(4, "none", None, 2, 8)


@pytest.mark.parametrize("overrides, message", [
    (["train.expert_parallel=3"], "train.expert_parallel: 3 does not divide the 8 routed experts"),
    (["model=debug_dense", "train.expert_parallel=2"], "has no routed experts"),
    (["train.expert_parallel=2", "train.sharding=none"], "needs train.sharding=fsdp or hsdp"),
    (["train.shard_group_size=2"], "train.shard_group_size: is HSDP's shard group size"),
    (["train.expert_dispatch_fp8=true"], "train.expert_dispatch_fp8: sends"),
    (["train.expert_parallel=0"], "must be >= 1"),
])
def test_bad_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(*overrides)


def test_the_plan_lists_the_layout_of_every_world_size_of_the_elastic_range():
    from orchestration.driver.plan import elastic_layouts

    job = compose_job("train.expert_parallel=2", "cluster.min_workers=1", "cluster.max_workers=4",
                      "train.global_batch_size=16")
    assert elastic_layouts(job) == {"1": "one worker", "2": "FSDP over 2, experts over 2", "3": "FSDP over 3",
                                    "4": "FSDP over 4, experts over 2"}


def test_a_good_layout_validates():
    job = compose_job("train.expert_parallel=2", "train.sharding=hsdp", "train.shard_group_size=2",
                      "train.expert_dispatch_fp8=true")
    assert (job.train.expert_parallel, job.train.sharding, job.train.shard_group_size) == (2, "hsdp", 2)


# ---------------------------------------------------------------------------------------------------------------
# The scaling model's prices for HSDP and expert parallelism (models/scaling.py)


def _moe_plan(*overrides: str) -> dict:
    from orchestration.driver.plan import scaling_plan

    job = compose_job("model=deepseek_moe16b", "cluster.fabric=nvlink_ib400", "cluster.device=cuda",
                      "cluster.memory_per_worker_gb=80", "data.seq_len=4096", "train.micro_batch_size=2", *overrides)
    return scaling_plan(job)


def test_all_to_all_and_replica_collectives_follow_the_fabric():
    from models import scaling

    f = scaling.FABRICS["nvlink_ib400"]
    gb = 1e9
    # inside a node: the 7/8 bound for the others over NVLink, one step of latency
    assert scaling.all_to_all_s(gb, 8, f) == pytest.approx(
        7 / 8 * gb / (f.intra_node_gbs * 1e9) + (f.collective_base_us + f.intra_hop_us) * 1e-6)
    # 16 ranks over two nodes: 8 of the 15 peers are remote, reached through the GPU's own NIC
    assert scaling.all_to_all_s(gb, 16, f) == pytest.approx(
        15 / 16 * gb * 8 / 15 / (f.inter_node_gbs * 1e9) + (f.collective_base_us + f.inter_hop_us) * 1e-6)
    # replicas a node apart: each GPU's ring through its own NIC only
    assert scaling.strided_ring_s(gb, 16, 8, f) == pytest.approx(
        15 / 16 * gb / (f.inter_node_gbs * 1e9) + (f.collective_base_us + 15 * f.inter_hop_us) * 1e-6)
    assert scaling.all_to_all_s(gb, 1, f) == scaling.strided_ring_s(gb, 1, 8, f) == 0.0


def test_default_layout_is_the_fsdp_model_and_hsdp_ep_change_the_step():
    from models import scaling

    run = scaling.PUBLISHED_RUNS[0]
    w = dataclasses.replace(run.workload, compute_s=1.0, expert_params=run.workload.params_per_layer * 16,
                            moe_layers=16, dim=4096, top_k=2)
    f, p = scaling.FABRICS["nvlink_ib400"], scaling.Precision(False, False, 2, 4)
    fsdp = scaling.predict_step(w, p, f, 128)
    # one shard group of every GPU is FSDP
    assert scaling.predict_step(w, p, f, 128, scaling.Layout(shard_group_size=128)).step_s == fsdp.step_s
    hsdp = scaling.predict_step(w, p, f, 128, scaling.Layout(shard_group_size=8))
    ep = scaling.predict_step(w, p, f, 128, scaling.Layout(expert_parallel=8))
    ep_fp8 = scaling.predict_step(w, p, f, 128, scaling.Layout(expert_parallel=8, fp8_dispatch=True))
    # HSDP gathers inside the node but all-reduces the gradient shards across 16 nodes
    assert hsdp.comm_s != fsdp.comm_s
    # expert parallelism adds exposed all-to-alls and takes half the parameters out of the gathers
    assert ep.exposed_comm_s > fsdp.exposed_comm_s and ep_fp8.exposed_comm_s < ep.exposed_comm_s
    assert scaling.state_bytes_per_gpu(w, scaling.Layout(expert_parallel=8), 128) > \
        scaling.state_bytes_per_gpu(w, scaling.Layout(), 128)


def test_dry_run_picks_a_layout_for_deepseek_moe16b_at_128_gpus_at_half_efficiency_or_better():
    plan = _moe_plan("cluster.min_workers=128", "cluster.max_workers=128")
    layout = plan["layout"]
    assert layout["source"] == "chosen" and layout["scaling_efficiency"] >= 0.5, layout
    assert layout["bytes_per_gpu"] <= 0.9 * 80 * 1024**3
    fitting = [r for r in layout["candidates"] if r["fits"]]
    assert layout["tokens_per_s_per_gpu"] == max(r["tokens_per_s_per_gpu"] for r in fitting)
    assert {r["layout"] for r in layout["candidates"]} >= {"fsdp 128", "hsdp 16x8", "fsdp 128 + ep 8"}


def test_dry_run_predicts_a_configured_layout():
    plan = _moe_plan("cluster.min_workers=16", "cluster.max_workers=16", "train.sharding=hsdp",
                     "train.expert_parallel=8", "train.global_batch_size=32")
    assert plan["layout"]["label"] == "hsdp 2x8 + ep 8" and plan["layout"]["source"] == "configured"
