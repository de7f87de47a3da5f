"""A run directory read into what the report shows: its files (RunData) and its per-step series (RunSeries).

Steps can go back: after a rollback to step s, steps s+1.. are logged again. segments() splits a curve where the
step goes back (the plots keep the abandoned stretch visible); effective_curve() keeps, for every step, the value
logged last (what comparisons use).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestration.observability.events import CONFIG_FILE, EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, read_jsonl


@dataclass
class RunData:
    """One run directory, read."""

    path: Path
    label: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any]


@dataclass
class RunSeries:
    """What the plots of one run show (x = optimizer step, in logging order; None where not logged)."""

    label: str
    loss_steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)  # held-out evaluations (train.eval_every)
    eval_loss: list[float] = field(default_factory=list)
    throughput_steps: list[int] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    mfu_steps: list[int] = field(default_factory=list)
    mfu: list[float] = field(default_factory=list)
    world_size_steps: list[int] = field(default_factory=list)
    world_size: list[int] = field(default_factory=list)
    precision_steps: list[int] = field(default_factory=list)
    precision: list[str] = field(default_factory=list)
    fallback_steps: list[int] = field(default_factory=list)  # precision_changed to bf16
    recovery_steps: list[int] = field(default_factory=list)  # precision_changed back to fp8
    rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (from_step it happened at, to_step)
    restart_steps: list[int] = field(default_factory=list)  # resume events (failures and resizes)
    worker_lost_steps: list[int] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ reading


def is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).exists() or (path / EVENTS_FILE).exists()


def expand_run_dirs(paths: Sequence[Path]) -> list[Path]:
    """Run directories named, or found one level below a named directory (a sweep); ValueError if none."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ValueError(f"{p} is not a directory; pass run directories (with metrics.jsonl/events.jsonl)")
        if is_run_dir(p):
            found.append(p)
            continue
        children = sorted(c for c in p.iterdir() if c.is_dir() and is_run_dir(c))
        if not children:
            raise ValueError(f"{p} has no {METRICS_FILE} or {EVENTS_FILE}, nor run directories below it")
        found.extend(children)
    return found


def _is_primary(event: dict[str, Any]) -> bool:
    # Agreed decisions are written by every rank, each copy tagged with its writer's worker_rank: keep rank 0's
    # copy (records without worker_rank have one writer). "rank" is something else: the rank that detected.
    return event.get("worker_rank", 0) in (0, None)


def load_run(path: Path, label: str | None = None) -> RunData:
    path = Path(path)
    if not is_run_dir(path):
        raise ValueError(f"{path} is not a run directory (no {METRICS_FILE} or {EVENTS_FILE})")
    config: dict[str, Any] = {}
    if (path / CONFIG_FILE).exists():
        loaded = yaml.safe_load((path / CONFIG_FILE).read_text())
        config = loaded if isinstance(loaded, dict) else {}
    summary: dict[str, Any] = {}
    if (path / SUMMARY_FILE).exists():
        try:
            summary = json.loads((path / SUMMARY_FILE).read_text())
        except json.JSONDecodeError:
            summary = {}
    return RunData(path=path, label=label or path.name, config=config, metrics=read_jsonl(path / METRICS_FILE),
                   events=read_jsonl(path / EVENTS_FILE), summary=summary)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def run_series(run: RunData) -> RunSeries:
    """The data every plot of this run draws, straight from metrics.jsonl and events.jsonl (pure)."""
    s = RunSeries(label=run.label)
    for m in run.metrics:
        step = m.get("step")
        if step is None:
            continue
        if _num(m.get("loss")) is not None:
            s.loss_steps.append(step)
            s.loss.append(m["loss"])
        if _num(m.get("eval_loss")) is not None:
            s.eval_steps.append(step)
            s.eval_loss.append(m["eval_loss"])
        if _num(m.get("tokens_per_s")) is not None:
            s.throughput_steps.append(step)
            s.tokens_per_s.append(m["tokens_per_s"])
        if _num(m.get("mfu")) is not None:
            s.mfu_steps.append(step)
            s.mfu.append(m["mfu"])
        if _num(m.get("world_size")) is not None:
            s.world_size_steps.append(step)
            s.world_size.append(m["world_size"])
        if m.get("precision") is not None:
            s.precision_steps.append(step)
            s.precision.append(str(m["precision"]))
    for e in run.events:
        name, step = e.get("event"), e.get("step")
        if step is None or not _is_primary(e):
            continue
        if name == "precision_changed" and str(e.get("to")).lower() == "bf16":
            s.fallback_steps.append(step)
        elif name == "precision_changed" and str(e.get("to")).lower() == "fp8":
            s.recovery_steps.append(step)
        elif name == "rollback":
            # the worker writes it after restoring (step = to_step) with from_step = where it happened
            s.rollbacks.append((e.get("from_step", step), e.get("to_step")))
        elif name == "resume":
            s.restart_steps.append(step)
        elif name == "worker_lost":
            s.worker_lost_steps.append(step)
    return s


def segments(steps: Sequence[int], values: Sequence[Any]) -> list[tuple[list[int], list[Any]]]:
    """Split a logged series where the step goes back (a rollback or a restart from an older checkpoint)."""
    out: list[tuple[list[int], list[Any]]] = []
    for step, value in zip(steps, values):
        if not out or step <= out[-1][0][-1]:
            out.append(([], []))
        out[-1][0].append(step)
        out[-1][1].append(value)
    return out


def effective_curve(steps: Sequence[int], values: Sequence[Any]) -> dict[int, Any]:
    """step -> the value logged last for it (what the run finally trained on), sorted by step."""
    last: dict[int, Any] = {}
    for step, value in zip(steps, values):
        last[step] = value
    return dict(sorted(last.items()))


def precision_spans(steps: Sequence[int], precision: Sequence[str]) -> list[tuple[int, int, str]]:
    """(start step, end step, precision) of the effective precision timeline (pure).

    Uses the effective curve (after a rollback the re-run steps count, the abandoned ones do not); each logged
    precision holds until the next logged step, so spans touch without gaps.
    """
    curve = effective_curve(steps, precision)
    points = list(curve.items())
    spans: list[tuple[int, int, str]] = []
    for i, (step, prec) in enumerate(points):
        end = points[i + 1][0] if i + 1 < len(points) else step
        if spans and spans[-1][2] == prec:
            spans[-1] = (spans[-1][0], end, prec)
        else:
            spans.append((step, end, prec))
    return spans
