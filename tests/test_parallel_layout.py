"""The parallel layout a world size runs (HSDP shard groups, expert parallelism), the config checks around it, and the
planner's choice of layout for a cluster. Pure functions: no processes."""

from __future__ import annotations

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
    lowered = layout.expert_parallel != ep and world > 1 or (sharding == "hsdp" and group and
                                                            layout.shard_group_size != group)
    assert bool(layout.notes) == bool(lowered), layout.notes


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
    (["train.expert_parallel=4"], "more than cluster.max_workers=2"),
    (["model=debug_dense", "train.expert_parallel=2"], "has no routed experts"),
    (["train.expert_parallel=2", "train.sharding=none"], "needs train.sharding=fsdp or hsdp"),
    (["train.shard_group_size=2"], "train.shard_group_size: is HSDP's shard group size"),
    (["train.expert_dispatch_fp8=true"], "train.expert_dispatch_fp8: sends"),
    (["train.expert_parallel=0"], "must be >= 1"),
])
def test_bad_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(*overrides)


def test_a_good_layout_validates():
    job = compose_job("train.expert_parallel=2", "train.sharding=hsdp", "train.shard_group_size=2",
                      "train.expert_dispatch_fp8=true")
    assert (job.train.expert_parallel, job.train.sharding, job.train.shard_group_size) == (2, "hsdp", 2)
