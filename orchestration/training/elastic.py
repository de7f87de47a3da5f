"""Elastic plan: how a constant global batch splits over whatever world size Ray Train gave us.

Recomputed at every (re)start. The global batch (sequences, hence tokens) never changes with the world size, so the
loss trajectory does not depend on how many workers happen to be alive; only the split into per-worker
micro-batches and gradient-accumulation steps does. A world size that does not divide the global batch is fine:
ranks get chunks whose sizes differ by one, every rank runs the same number of micro-steps (FSDP's collectives must
line up), and each micro-batch's loss is weighted by its share of the global batch, so the gradient is the mean over
exactly the global batch at any world size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
