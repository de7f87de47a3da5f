"""Elastic plan: how a constant global batch splits over whatever world size Ray Train gave us.

Recomputed at every (re)start. The global batch (sequences, hence tokens) never changes with the world size, so the
loss trajectory does not depend on how many workers happen to be alive; only the split into per-worker
micro-batches and gradient-accumulation steps does. A world size that does not divide the global batch is fine:
ranks get chunks whose sizes differ by one, every rank runs the same number of micro-steps (FSDP's collectives must
line up), and each micro-batch's loss is weighted by its share of the global batch, so the gradient is the mean over
exactly the global batch at any world size.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestration.config import JobConfig


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    global_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # largest number of sequences per worker per forward
    grad_accum: int  # forwards per worker per optimizer step (the same on every rank)

    def to_dict(self) -> dict:
        return {**asdict(self), "even": self.even}

    @property
    def even(self) -> bool:
        return self.global_batch_size % (self.world_size * self.micro_batch_size) == 0 and \
            self.global_batch_size // self.world_size == self.micro_batch_size * self.grad_accum

    def rank_range(self, rank: int) -> tuple[int, int]:
        """This rank's contiguous chunk [start, end) of the global batch; chunk sizes differ by at most one."""
        base, extra = divmod(self.global_batch_size, self.world_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)

    def sample_slice(self, rank: int, micro_step: int) -> tuple[int, int]:
        """Offsets [start, end) inside the global batch for this rank's micro-step; may be empty (start == end)."""
        lo, hi = self.rank_range(rank)
        start = min(lo + micro_step * self.micro_batch_size, hi)
        return start, min(start + self.micro_batch_size, hi)

    def loss_weight(self, num_samples: int) -> float:
        """Factor for a micro-batch's mean loss so that, after the gradient mean over ranks (FSDP reduce-scatter
        or all-reduce average), the update equals the mean over the whole global batch."""
        return num_samples * self.world_size / self.global_batch_size


def plan_batch(global_batch_size: int, micro_batch_size: int, world_size: int) -> BatchPlan:
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if micro_batch_size < 1:
        raise ValueError(f"micro batch size must be >= 1, got {micro_batch_size}")
    if global_batch_size < world_size:
        raise ValueError(
            f"global batch of {global_batch_size} sequences is smaller than {world_size} workers: every worker "
            f"needs at least one sequence; raise train.global_batch_size to >= {world_size} or lower "
            f"cluster.max_workers")
    per_worker_max = -(-global_batch_size // world_size)
    if global_batch_size % world_size == 0:
        # Even split: the largest micro-batch <= the configured one that divides the per-worker share.
        micro = min(micro_batch_size, per_worker_max)
        while per_worker_max % micro:
            micro -= 1
    else:
        micro = min(micro_batch_size, per_worker_max)
    return BatchPlan(world_size=world_size, global_batch_size=global_batch_size, micro_batch_size=micro,
                     grad_accum=-(-per_worker_max // micro))


def merge_ranges(ranges: list[list[int]]) -> list[list[int]]:
    """Union of half-open [start, end) ranges, sorted and coalesced."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def count_in_ranges(ranges: list[list[int]]) -> int:
    return sum(end - start for start, end in ranges)


@dataclass(frozen=True)
class ParallelLayout:
    """How one world size runs the model: FSDP or HSDP (shard groups of shard_group_size ranks, replicated), and the
    routed experts split over groups of expert_parallel ranks (1: not split)."""

    world_size: int
    sharding: str  # "fsdp", "hsdp" or "none"
    shard_group_size: int  # ranks a parameter is sharded over (world_size under fsdp, 1 under none)
    expert_parallel: int
    notes: tuple[str, ...] = ()

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_group_size

    def describe(self) -> str:
        if self.world_size <= 1:
            return "one worker"
        kind = {"fsdp": f"FSDP over {self.world_size}", "none": f"{self.world_size} replicas",
                "hsdp": f"HSDP {self.replicas} x {self.shard_group_size}"}[self.sharding]
        return kind + (f", experts over {self.expert_parallel}" if self.expert_parallel > 1 else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "notes": list(self.notes), "replicas": self.replicas, "describe": self.describe()}


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def plan_layout(world_size: int, sharding: str, shard_group_size: int | None, expert_parallel: int,
                n_routed_experts: int = 0, gpus_per_node: int | None = None) -> ParallelLayout:
    """The layout a world size allows, as close to the configured one as it gets. Recomputed at every (re)start, so
    an elastic resize keeps a valid layout: expert parallelism must divide the world size and the routed experts,
    so it drops to the largest degree <= the configured one that divides both; HSDP's shard group must divide the
    world size, so it drops to the largest divisor <= the configured size (null: gpus_per_node, else the world).
    Why not refuse: a shrink from 8 to 6 workers would otherwise end an EP 4 run that EP 2 can continue (the
    checkpoint reshards across layouts)."""
    notes: list[str] = []
    if world_size <= 1:
        if expert_parallel > 1:
            # Said, so a shrink to one worker explains why the layout lost its expert parallelism.
            notes.append(f"expert parallelism {expert_parallel} lowered to 1 (one worker holds all the routed experts)")
        return ParallelLayout(world_size, "none", 1, 1, tuple(notes))
    if sharding == "none":
        if expert_parallel > 1:
            raise ValueError("train.expert_parallel > 1 needs train.sharding=fsdp or hsdp; set "
                             "train.expert_parallel=1 or train.sharding=fsdp")
        return ParallelLayout(world_size, "none", 1, 1)
    ep = 1
    if expert_parallel > 1:
        if n_routed_experts <= 0:
            raise ValueError("train.expert_parallel > 1 needs a model with routed experts (a DeepSeek-MoE flavor); "
                             "set train.expert_parallel=1")
        ep = _largest_divisor_at_most(math.gcd(world_size, n_routed_experts), expert_parallel)
        if ep != expert_parallel:
            notes.append(f"expert parallelism {expert_parallel} lowered to {ep} (it must divide the world size "
                         f"{world_size} and the {n_routed_experts} routed experts)")
    if sharding == "fsdp":
        return ParallelLayout(world_size, "fsdp", world_size, ep, tuple(notes))
    wanted = shard_group_size or gpus_per_node or world_size
    group = _largest_divisor_at_most(world_size, wanted)
    if group != wanted:
        notes.append(f"HSDP shard group {wanted} lowered to {group} (it must divide the world size {world_size})")
    return ParallelLayout(world_size, "hsdp", group, ep, tuple(notes))


def layout_for(job: JobConfig, world_size: int, n_routed_experts: int,
               gpus_per_node: int | None = None) -> ParallelLayout:
    """The parallel layout this world size runs (plan_layout): at every (re)start, so a resize keeps expert parallelism
    and HSDP's shard groups dividing the world size. HSDP's group left null is a node's GPUs: gpus_per_node (the dry
    run's fabric), else this node's workers."""
    return plan_layout(world_size, job.train.sharding, job.train.shard_group_size, job.train.expert_parallel,
                       n_routed_experts, gpus_per_node=gpus_per_node or workers_per_node(world_size))


def workers_per_node(world_size: int) -> int:
    """The workers of this node (LOCAL_WORLD_SIZE, set by Ray Train and torchrun), or the whole world when that does
    not divide it (nodes of uneven sizes)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return local if local > 0 and world_size % local == 0 else world_size
