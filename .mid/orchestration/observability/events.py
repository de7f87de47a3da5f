"""The run directory (docs/run-directory.md): config.yaml, events.jsonl, metrics.jsonl, summary.json.

Every rank may append events (divergence verdicts are per rank); each line is one small JSON object written with a
single O_APPEND write, which Linux keeps whole on a local filesystem, so concurrent writers do not interleave.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import yaml

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
FINAL_STATE_FILE = "final_state.json"
# Written by the driver at Ctrl-C: the workers stop at their next logged step (orchestration/driver/ray_job.py).
STOP_FILE = "stop_requested"
# Written by the driver at SIGTERM: the workers save a checkpoint at their next step boundary, then stop.
PREEMPT_FILE = "preempt_requested"


def _append_line(path: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, sort_keys=False, default=_json_default) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDir:
    def __init__(self, path: str | Path, rank: int = 0):
        self.path = Path(path)
        self.rank = rank
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_config(self, config: dict[str, Any]) -> None:
        tmp = self.path / (CONFIG_FILE + ".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        os.replace(tmp, self.path / CONFIG_FILE)

    def event(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, "step": int(step), **fields}
        _append_line(self.path / EVENTS_FILE, record)
        return record

    def metrics(self, record: dict[str, Any]) -> None:
        _append_line(self.path / METRICS_FILE, {k: _finite_or_none(v) for k, v in record.items()})

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=_json_default))
        os.replace(tmp, self.path / name)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a killed writer; the rest of the log is still valid
    return records


def restarts_and_resumes(events: list[dict[str, Any]]) -> tuple[int, int]:
    """A worker group is a restart (Ray Train replaced a lost worker, or resized) unless it is the first one after a
    driver's run_start; that first one resumes (a resume) when the run had checkpoints (pure)."""
    restarts = resumes = 0
    first_of_start, in_first_group = True, False
    for e in events:
        if e["event"] == "run_start":
            first_of_start = True
        elif e["event"] == "worker_group_start" and e.get("worker_rank", 0) == 0:
            in_first_group, first_of_start = first_of_start, False
            restarts += 0 if in_first_group else 1
        elif e["event"] == "resume" and in_first_group:
            resumes += 1
    return restarts, resumes


def summarize(run_dir: Path, status: str, wall_time_s: float | None = None) -> dict[str, Any]:
    """summary.json from the run directory alone, so it is right across restarts and resizes."""
    events = read_jsonl(run_dir / EVENTS_FILE)
    metrics = read_jsonl(run_dir / METRICS_FILE)
    final_state = {}
    if (run_dir / FINAL_STATE_FILE).exists():
        final_state = json.loads((run_dir / FINAL_STATE_FILE).read_text())

    def count(name: str) -> int:
        # Agreed decisions are logged by every worker; count them once (worker 0's copy, or driver events).
        return sum(1 for e in events if e["event"] == name and e.get("worker_rank", 0) == 0)

    starts = [e for e in events if e["event"] == "worker_group_start"]
    restarts, resumes = restarts_and_resumes(events)
    losses = [m for m in metrics if m.get("loss") is not None]
    evals = [m for m in metrics if m.get("eval_loss") is not None]
    tput = [m["tokens_per_s"] for m in metrics if m.get("tokens_per_s")]
    restart_timings = [
        {k: e.get(k) for k in ("from_step", "world_size", "downtime_s", "setup_s", "checkpoint_load_s")}
        for e in events if e["event"] == "resume"
    ]
    # What checkpointing cost the run: the seconds training stood still for saves (rank 0's view; a background
    # save counts only its host copy), and how many were written in the background.
    saves = [e for e in events if e["event"] == "checkpoint_timing" and e.get("seconds") is not None]
    return {
        "status": status,
        "final_step": final_state.get("step", metrics[-1]["step"] if metrics else 0),
        "first_loss": losses[0]["loss"] if losses else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        # Held-out loss of the last evaluation (train.eval_every; the last step always evaluates), and what an
        # evaluation cost in seconds on average.
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_step": evals[-1]["step"] if evals else None,
        "eval_s_mean": round(sum(m.get("eval_s", 0.0) for m in evals) / len(evals), 4) if evals else None,
        "world_sizes_seen": sorted({e["world_size"] for e in starts}),
        "restarts": restarts,
        "resumes": resumes,
        "rollbacks": count("rollback"),
        "fallbacks": sum(1 for e in events if e["event"] == "precision_changed" and e.get("to") == "bf16"
                         and e.get("worker_rank", 0) == 0),
        # Steps whose update was dropped: skips, and fallbacks to BF16 (a fallback skips the step that caused it).
        "skipped_steps": count("step_skipped") + sum(1 for e in events if e["event"] == "precision_changed"
                                                     and e.get("to") == "bf16" and e.get("worker_rank", 0) == 0),
        # An interrupted or failed run has no final state: its last metrics line says how far it got.
        "samples_consumed": final_state.get("samples_consumed",
                                            metrics[-1].get("samples_consumed") if metrics else None),
        "consumed_ranges": final_state.get("consumed_ranges"),
        "skipped_ranges": final_state.get("skipped_ranges"),
        "tokens_per_s": (sum(tput) / len(tput)) if tput else None,
        "restart_timings": restart_timings,
        "checkpoint_saves": len(saves),
        "checkpoint_background_saves": sum(1 for e in saves if e.get("background")),
        "checkpoint_stall_s": round(sum(e["seconds"] for e in saves), 3),
        "wall_time_s": wall_time_s,
    }
