"""Where everything the worker reports goes: events.jsonl and metrics.jsonl in the run directory, and on rank 0 the
W&B run and the Ray metrics. The loop, the decisions and the checkpoints report through one RunObserver; none of
them writes a record or talks to a logger itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from orchestration.config import JobConfig
from orchestration.observability.events import RunDir

log = logging.getLogger(__name__)


class RunObserver:
    """One worker's reports. Every record carries the step of `progress` (the TrainingState) unless given one."""

    def __init__(self, run_dir: RunDir, rank: int, progress: Any):
        self.run_dir = run_dir
        self.rank = rank
        self.progress = progress  # anything with a `step`: the TrainingState
        self.wandb = None
        self.ray_metrics = None

    def start_loggers(self, job: JobConfig, recipe: str | None) -> None:
        """W&B and Ray metrics for this run (rank 0 only)."""
        if self.rank != 0:
            return
        run_dir = self.run_dir.path
        tags = {"model": job.model.name, "precision": job.precision.name, "run": run_dir.name}
        if job.logging.ray_metrics:
            try:
                from orchestration.observability.ray_metrics import TrainingMetrics

                self.ray_metrics = TrainingMetrics(tags)
            except Exception as exc:  # noqa: BLE001  # outside Ray (torchrun, tests) there is no metrics agent
                log.info("Ray metrics disabled: %s", exc)
        if job.logging.wandb and job.logging.wandb_mode != "disabled":
            from orchestration.config import to_dict
            from orchestration.observability.wandb_logger import WandbRun

            config = to_dict(job)  # WandbRun drops secrets itself
            if recipe:
                config["precision"]["recipe"] = recipe  # the resolved recipe, not "auto"
            self.wandb = WandbRun(run_dir, config, project=job.logging.project,
                                  group=job.logging.group or job.model.name, mode=job.logging.wandb_mode)

    def event(self, name: str, all_ranks: bool = False, step: int | None = None, **fields: Any) -> None:
        """Append to events.jsonl (every worker for agreed decisions, else rank 0) and feed rank 0's loggers."""
        step = self.progress.step if step is None else step
        if all_ranks:
            record = self.run_dir.event(name, step, worker_rank=self.rank, **fields)
        elif self.rank == 0:
            record = self.run_dir.event(name, step, **fields)
        else:
            return
        if self.rank == 0:
            self._wandb("log_event", record)
            if self.ray_metrics is not None:
                self.ray_metrics.record_event(record)

    def metrics(self, record: dict[str, Any], gauges: Callable[[], dict[str, float]]) -> None:
        """Rank 0: one metrics.jsonl line, to W&B and Ray too; `gauges` (read only when Ray metrics are on: a host
        read) are the dashboards' extra values."""
        if self.rank != 0:
            return
        self.run_dir.metrics(record)
        self._wandb("log_metrics", record["step"], record)
        if self.ray_metrics is not None:
            self.ray_metrics.update(record)
            for name, value in gauges().items():
                self.ray_metrics.set(name, value)

    def finish(self, summary: dict[str, Any]) -> None:
        self._wandb("finish", summary)

    def _wandb(self, method: str, *args: Any) -> None:
        """One call into the W&B run; an error there disables W&B for the rest of the run with one message
        instead of stopping training (observability never kills a run; metrics.jsonl and events.jsonl remain)."""
        if self.wandb is None:
            return
        try:
            getattr(self.wandb, method)(*args)
        except Exception as exc:  # noqa: BLE001 - any W&B failure: disable it, keep training
            log.warning("W&B logging disabled after an error in %s: %s: %s", method, type(exc).__name__, exc)
            self.wandb = None
