"""Python garbage collection during training: on a schedule, not whenever allocation counters say so.

Why: CPython's automatic collector runs when allocation counts cross its thresholds, and every few hundred young
collections it walks every tracked object. After torch.compile that heap holds dynamo's and Inductor's caches
(graphs, guards, generated modules), so a collection stalls the host at a step chosen by chance. The host feeds
the GPU (kernel launches, the FP8 grouped GEMM's eager op bodies), so the stall becomes GPU idle; on a
multi-rank run each rank stalls at a different step and every collective waits for the slowest. Scheduled:
automatic collection off while the loop runs, a full collection before it starts (setup garbage), and a
young-generation collection (generation 1) every `every_steps` steps - at the same step on every rank, so the
pauses line up. every_steps=0 keeps Python's automatic collector.

Reference cycles older than generation 1 are left for the collector after the loop (or a process exit): the
training loop's steady state allocates tensors freed by reference counting, not long-lived cycles.
"""

from __future__ import annotations

import gc
from typing import Self


class ManagedGc:
    """Context manager for the training loop; call `step(step)` once per optimizer step."""

    def __init__(self, every_steps: int):
        if every_steps < 0:
            raise ValueError(f"gc every_steps must be >= 0 (0 = Python's automatic GC), got {every_steps}")
        self.every_steps = every_steps
        self.collections = 0
        self._was_enabled = gc.isenabled()

    @property
    def active(self) -> bool:
        return self.every_steps > 0

    def __enter__(self) -> Self:
        if self.active:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.active and self._was_enabled:
            gc.enable()

    def step(self, step: int) -> bool:
        """Collect the young generations if `step` (optimizer steps taken) is due; True if it collected."""
        if self.active and step > 0 and step % self.every_steps == 0:
            gc.collect(1)
            self.collections += 1
            return True
        return False
