"""What one worker trains and where it stands (TrainingState), and what stays fixed for the length of one worker-group
lifetime (WorkerContext). The step reads and writes the first; the loop, the decisions and the checkpoints get both
passed explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from orchestration.config import JobConfig
from orchestration.divergence.guard import StepGuard
from orchestration.observability.events import RunDir
from orchestration.training.elastic import BatchPlan, merge_ranges
from orchestration.training.process_group import DistInfo
from orchestration.training.step import StepModel

# The fields a checkpoint's extra state holds as "train_state" (everything a resume restores besides the tensors).
PROGRESS_FIELDS = ("step", "cursor", "consumed_ranges", "skipped_ranges", "precision", "lr_scale")


@dataclass(frozen=True)
class WorkerContext:
    """What stays fixed while one worker group lives: the job, this rank's place in it, the run directory, the data."""

    job: JobConfig
    dist: DistInfo
    run_dir: RunDir
    plan: BatchPlan  # this world size's split of the global batch
    dataset: Any  # the training stream (orchestration.data.select.build_datasets)
    validation: Any  # the held-out stream, or None
    under_ray: bool  # started by the Ray driver (orchestration.driver.ray_job): checkpoints are reported to Ray Train
    group_id: str

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def device(self) -> torch.device:
        return self.dist.device


@dataclass
class TrainingState:
    """The model and optimizer as the step runs them, the LR schedule, and the run's progress: the next step, the
    next global sample index, which samples updated the weights or were dropped, the precision in force and the
    rollback's LR scale. A checkpoint saves all of it (the progress as its extra state's "train_state")."""

    step_model: StepModel
    scheduler: torch.optim.lr_scheduler.LRScheduler
    recipe: str | None  # the FP8 recipe the model was converted with; None for a bf16 run
    step: int = 0  # optimizer steps taken (the next step to run)
    cursor: int = 0  # next global sample index
    consumed_ranges: list[list[int]] = field(default_factory=list)  # samples whose update was kept
    skipped_ranges: list[list[int]] = field(default_factory=list)  # samples deliberately dropped (skip, rollback)
    precision: str = "fp8"  # the whole model's precision in force (a layer-scoped fallback does not change it)
    lr_scale: float = 1.0
    # Called with a reason wherever the weights changed outside the optimizer (weights_changed).
    weights_listeners: list[Callable[[str], None]] = field(default_factory=list, repr=False)

    @property
    def model(self) -> torch.nn.Module:
        return self.step_model.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.step_model.optimizer

    def progress(self) -> dict[str, Any]:
        """The progress as a checkpoint's "train_state" and final_state.json hold it."""
        return {name: getattr(self, name) for name in PROGRESS_FIELDS}

    def load_progress(self, data: dict[str, Any]) -> None:
        """A checkpoint's "train_state"; a field it lacks (an older checkpoint) takes its default."""
        defaults = TrainingState(self.step_model, self.scheduler, self.recipe)
        for name in PROGRESS_FIELDS:
            setattr(self, name, data.get(name, getattr(defaults, name)))

    def advance(self, global_batch_size: int, updated: bool) -> None:
        """One step done: its samples count as consumed (the update was kept) or skipped (a bad step never updates
        the weights)."""
        step_range = [self.cursor, self.cursor + global_batch_size]
        if updated:
            self.consumed_ranges = merge_ranges(self.consumed_ranges + [step_range])
        else:
            self.skipped_ranges = merge_ranges(self.skipped_ranges + [step_range])
        self.step += 1
        self.cursor += global_batch_size

    def skip_to(self, cursor: int) -> list[int]:
        """Drop the samples from the cursor to `cursor` (a rollback's window); returns that range."""
        skipped = [self.cursor, cursor]
        self.skipped_ranges = merge_ranges(self.skipped_ranges + [skipped])
        self.cursor = cursor
        return skipped

    def set_precision(self, precision: str, scope: tuple[str, ...] | None = None) -> None:
        """fp8.set_precision on the model: the whole model (its precision in force changes) or the layers `scope`."""
        self._switch(precision, scope)
        self.weights_changed(f"precision {precision}" + (f" for {', '.join(scope)}" if scope else ""))

    def follow_policy_precision(self, guard: StepGuard) -> None:
        """Put the model in the precision the guard's policy has in force: the run's mode, then the layers a
        layer-scoped fallback holds in bf16 (a whole-model switch alone would silently return them to FP8). A bf16
        run has nothing to switch."""
        if not guard.fp8_run:
            return
        precision, bf16_layers = guard.precision_in_force()
        self._switch(precision, None)
        if bf16_layers:
            self._switch("bf16", bf16_layers)
        self.weights_changed(f"precision {precision}" + (f", bf16 for {', '.join(bf16_layers)}" if bf16_layers else ""))

    def _switch(self, precision: str, scope: tuple[str, ...] | None) -> None:
        import fp8

        fp8.set_precision(self.model, precision, scope=list(scope) if scope else None)
        if scope is None:
            self.precision = precision

    def weights_changed(self, reason: str) -> None:
        """The one signal that the weights, or the precision they compute in, changed outside the optimizer: a
        checkpoint load (resume, rollback), imported weights, a precision switch (fallback to BF16 and back).
        Whatever keeps its own copy of the weights (a cache, another layout of them) registers in
        weights_listeners and refreshes there."""
        for listener in self.weights_listeners:
            listener(reason)
