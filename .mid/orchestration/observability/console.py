"""What the driver prints while a run trains, read from the run directory as the workers write it: a progress line
(step, loss, seconds per step, time left) and one line per event a person watching cares about (a skipped update,
FP8 -> BF16 and back, a rollback, a restart, a resize, a resume, a failed checkpoint, an evaluation).

`ConsoleLines` turns records into lines and holds no file or clock of its own (tests feed it records);
`RunDirTail` reads the lines the workers appended since the last look.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENT_PREFIX = "[event]"
PROGRESS_PREFIX = "[progress]"


def _decided_once(record: dict[str, Any]) -> bool:
    """Agreed decisions are written by every worker: worker 0's copy (or a record without a worker rank)."""
    return record.get("worker_rank", 0) == 0


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else str(value)


def _scope(e: dict[str, Any]) -> str:
    scope = e.get("scope")
    return "whole model" if scope in (None, "", "model") else f"layers {scope}"


def duration(seconds: float) -> str:
    """12 s, 4m05s, 2h03m (pure)."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass
class ConsoleLines:
    """Console lines from events.jsonl and metrics.jsonl records, in the order the run wrote them."""

    total_steps: int
    every_s: float
    # the divergence findings behind the decision about to be written, by step: its cause on the decision's line
    _findings: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    _decisions: dict[int, dict[str, Any]] = field(default_factory=dict)
    _last_progress_time: float | None = None
    _last_progress_step: int | None = None
    # (time, step) from which the next progress line measures seconds per step: the previous progress line's
    _window: tuple[float, int] | None = None
    _last_step: int | None = None
    _groups_seen: int = 0

    # -- events ------------------------------------------------------------------------------------------------
    def event(self, e: dict[str, Any]) -> str | None:
        if not _decided_once(e):
            return None
        name, step = e.get("event"), e.get("step")
        if name == "divergence_detected":
            self._findings.setdefault(step, []).append(e)
            return None
        if name == "policy_decision":
            self._decisions[step] = e
        # a rollback is written at the step it restored; it happened at the bad step, where its cause was found
        step = e.get("from_step", step) if name == "rollback" else step
        text = self._event_text(name, step, e)
        if text is None:
            return None
        return f"{EVENT_PREFIX} step {step}: {text}"

    def _cause(self, step: int) -> str:
        findings = self._findings.pop(step, [])
        parts = [f"{f['detector']} {_num(f.get('value'), '.4g')} > {_num(f.get('threshold'), '.4g')} on rank "
                 f"{f.get('rank')}" for f in findings]
        return f" ({'; '.join(parts)})" if parts else ""

    def _event_text(self, name: str, step: int, e: dict[str, Any]) -> str | None:
        if name == "step_skipped":
            return f"update skipped{self._cause(step) or ' (' + str(e.get('reason')) + ')'}"
        if name == "precision_changed" and e.get("to") == "bf16":
            decision = self._decisions.pop(step, {})
            until = decision.get("until_step")
            return (f"FP8 -> BF16 for the {_scope(e)} {'until step ' + str(until) if until is not None else 'for good'}"
                    f", update dropped{self._cause(step)}")
        if name == "precision_changed" and e.get("to") == "fp8":
            return f"BF16 -> FP8 again for the {_scope(e)}"
        if name == "rollback":
            start, end = (e.get("skipped_range") or [None, None])[:2]
            lr = e.get("lr_scale")
            return (f"rolled back to step {e.get('to_step')}{self._cause(step)}; {e.get('skipped_samples')} samples "
                    f"skipped [{start}, {end})" + (f", learning rate x{_num(lr, '.3g')}" if lr not in (None, 1.0) else ""))
        if name == "rollback_unavailable":
            return f"cannot roll back: {e.get('reason')}"
        if name == "policy_decision" and e.get("decision") == "stop":
            return f"training stops: divergence persists{self._cause(step)}"
        if name == "worker_group_start":
            self._groups_seen += 1
            return (f"{e.get('world_size')} workers started ({e.get('backend')} on {e.get('device')}, "
                    f"{e.get('precision')}, grad accumulation {e.get('grad_accum')})")
        if name == "worker_lost":
            return (f"a worker was lost: restarted with {e.get('world_size')} workers "
                    f"(was {e.get('previous_world_size')})")
        if name == "workers_added":
            return f"resized: {e.get('previous_world_size')} -> {e.get('world_size')} workers"
        if name == "resume":
            what = "restarted" if e.get("origin") == "restart" else "resumed"
            down = e.get("downtime_s")
            return (f"{what} from checkpoint step {e.get('from_step')} on {e.get('world_size')} workers"
                    + (f", {_num(down, '.1f')} s after the last step" if down is not None else ""))
        if name == "checkpoint_failed":
            return f"checkpoint of step {e.get('checkpoint_step')} failed: {e.get('error')}"
        if name == "checkpoint_abandoned":
            return f"checkpoint abandoned: {e.get('error')}"
        if name == "eval_gap_exceeded":
            return (f"eval FP8/BF16 gap {_num(e.get('rel_gap'), '+.2%')} over the limit "
                    f"{_num(e.get('threshold'), '.2%')} (FP8 {_num(e.get('eval_loss_fp8'), '.4f')}, BF16 "
                    f"{_num(e.get('eval_loss_bf16'), '.4f')})")
        if name == "eval_unavailable":
            return f"no evaluation: {e.get('reason')}"
        return None

    # -- metrics -----------------------------------------------------------------------------------------------
    def metrics(self, m: dict[str, Any], now: float) -> list[str]:
        """Lines for one metrics.jsonl record read at `now`: its evaluation, if it has one, and a progress line for
        the first step seen, then at most one every `every_s` seconds."""
        lines = []
        step, t = m["step"], m.get("time", now)
        if self._window is None or (self._last_step is not None and step <= self._last_step):
            # the first record, or the step went back (a rollback, a restart): time it from its own step time
            self._window = (t - (m.get("step_time_s") or 0.0), step - 1)
        self._last_step = step
        if m.get("eval_loss") is not None:
            text = f"eval loss {_num(m['eval_loss'], '.4f')}"
            if m.get("eval_loss_bf16") is not None:
                text += (f" (BF16 {_num(m['eval_loss_bf16'], '.4f')}, FP8/BF16 gap "
                         f"{_num(m.get('eval_gap'), '+.2%')})")
            lines.append(f"{EVENT_PREFIX} step {step}: {text}")
        due = self._last_progress_time is None or now - self._last_progress_time >= self.every_s
        if due and step != self._last_progress_step:
            lines.append(self._progress(m, t))
            self._last_progress_time, self._last_progress_step = now, step
            self._window = (t, step)  # the next line's seconds per step: the steps since this one
        return lines

    def _progress(self, m: dict[str, Any], t: float) -> str:
        step = m["step"]
        t0, step0 = self._window
        s_per_step = (t - t0) / (step - step0) if step > step0 else None
        left = (self.total_steps - step) * s_per_step if s_per_step is not None else None
        loss = _num(m.get("loss"), ".4f") if m.get("loss") is not None else "nan"
        return (f"{PROGRESS_PREFIX} step {step:>6}/{self.total_steps}  loss {loss}  "
                f"{_num(s_per_step, '.2f')} s/step  ETA {duration(left) if left is not None else '?'}  "
                f"tok/s {_num(m.get('tokens_per_s') or 0, ',.0f')}  world {m.get('world_size')}  "
                f"{m.get('precision')}")

    def last(self, m: dict[str, Any], now: float) -> str | None:
        """The progress line of the newest record when the run ends, unless it was printed already."""
        if m["step"] == self._last_progress_step:
            return None
        self._last_progress_time, self._last_progress_step = now, m["step"]
        return self._progress(m, m.get("time", now))


class RunDirTail:
    """The complete lines appended to one JSONL file since the last read (a line still being written waits). A file
    replaced meanwhile (a resume rewrites metrics.jsonl without the steps it trains again) is read from its start,
    past the newest record already returned. Lines are not in time order across writers (every worker appends its
    copy of an agreed decision): only the replaced file is filtered by time."""

    def __init__(self, path: Path, since_time: float):
        self.path = path
        self.offset = 0
        self.inode: int | None = None
        # records written before this start (a resumed run's earlier starts) are not news
        self.since_time = since_time
        self.newest_time = since_time

    def read(self) -> list[dict[str, Any]]:
        after = None
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.inode:
                    after = self.newest_time if self.inode is not None else None
                    self.inode, self.offset = inode, 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        records = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed writer
            t = record.get("time", self.since_time)
            if t < self.since_time or (after is not None and t <= after):
                continue
            records.append(record)
            self.newest_time = max(self.newest_time, t)
        return records
