"""Elastic plan: how a constant global batch splits over whatever world size Ray Train gave us.

Recomputed at every (re)start. The global batch (sequences, hence tokens) never changes with the world size, so the
loss trajectory does not depend on how many workers happen to be alive; only the split into per-worker
micro-batches and gradient-accumulation steps does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    global_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per worker per forward
    grad_accum: int  # forwards per worker per optimizer step

    def to_dict(self) -> dict:
        return asdict(self)

    def sample_slice(self, rank: int, micro_step: int) -> tuple[int, int]:
        """Offsets [start, end) inside the global batch for this rank's micro-step.

        Micro-step-major order: micro-step a of every rank precedes micro-step a+1, so each micro-step of the whole
        group covers one contiguous block of world_size * micro_batch_size samples.
        """
        start = (micro_step * self.world_size + rank) * self.micro_batch_size
        return start, start + self.micro_batch_size


def plan_batch(global_batch_size: int, micro_batch_size: int, world_size: int) -> BatchPlan:
    """Largest micro-batch <= the configured one that splits the global batch evenly over world_size."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if global_batch_size % world_size != 0:
        raise ValueError(
            f"global batch of {global_batch_size} sequences cannot be split evenly over {world_size} workers; "
            f"choose a global_batch_size divisible by every world size in the elastic range "
            f"(e.g. {global_batch_size - global_batch_size % world_size + world_size})")
    per_worker = global_batch_size // world_size
    micro = min(micro_batch_size, per_worker)
    while per_worker % micro != 0:
        micro -= 1
    return BatchPlan(world_size=world_size, global_batch_size=global_batch_size, micro_batch_size=micro,
                     grad_accum=per_worker // micro)


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
