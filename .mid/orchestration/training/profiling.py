"""torch.profiler over a window of the training loop (train.profile_from_step, train.profile_steps): what the loop
itself spends - data, forward/backward, the divergence check, the optimizer, logging, checkpoint marks - not an
isolated step.

Each rank writes into the run directory's profile/: a Chrome trace (`*.pt.trace.json.gz`: Perfetto, chrome://tracing
or TensorBoard's profiler plugin open it) and a summary of where the window's wall time went (categories of
orchestration/observability/kernel_profile.py, the idle rest, the longest kernels). On a GPU only the device is
traced (CUPTI): tracing the host's operators too would slow the host and inflate the idle time being measured.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from orchestration.observability.kernel_profile import category_of, kernel_breakdown

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"
TOP_KERNELS = 30


class LoopProfiler:
    """Starts torch.profiler at the iteration whose step is `from_step` and stops it `steps` loop iterations later
    (a rollback inside the window does not stretch it), or when the loop ends first. from_step 0 = off."""

    def __init__(self, from_step: int, steps: int, run_path: Path, rank: int, device: torch.device):
        self.from_step, self.steps = from_step, steps
        self.out_dir = run_path / PROFILE_DIR
        self.rank, self.device = rank, device
        self.done = from_step == 0
        self.profiler: torch.profiler.profile | None = None
        self.steps_seen: list[int] = []  # the step of each profiled iteration (a rollback inside repeats steps)
        self.t_start = 0.0
        self.started_time = 0.0

    def before_step(self, step: int) -> dict[str, Any] | None:
        """Called at the top of every loop iteration; the summary when this call ended the window, else None."""
        if self.profiler is not None:
            if len(self.steps_seen) == self.steps:
                return self.stop()
            self.steps_seen.append(step)
        elif not self.done and step == self.from_step:
            self.start()
            self.steps_seen = [step]
        return None

    def start(self) -> None:
        on_gpu = self.device.type == "cuda"
        activity = torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU
        self.synchronize()
        self.profiler = torch.profiler.profile(activities=[activity])
        self.profiler.start()
        self.t_start, self.started_time = time.perf_counter(), time.time()

    def stop(self) -> dict[str, Any] | None:
        """End the window (also when the loop ends inside it); write the trace and the summary; the summary."""
        if self.profiler is None:
            return None
        self.synchronize()
        wall_ms = (time.perf_counter() - self.t_start) * 1e3
        profiler, self.profiler, self.done = self.profiler, None, True
        profiler.stop()
        steps = len(self.steps_seen)
        rows = profiler_rows(profiler, steps, self.device.type == "cuda")
        step_ms = wall_ms / steps
        name = f"rank{self.rank}_steps{self.steps_seen[0]}-{self.steps_seen[-1]}"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"{name}.pt.trace.json.gz"
        profiler.export_chrome_trace(str(trace))
        summary = {"rank": self.rank, "from_step": self.from_step, "steps": steps, "steps_seen": self.steps_seen,
                   "started_time": self.started_time, "device": str(self.device),
                   "traced": "device kernels" if self.device.type == "cuda" else "host operators (self time)",
                   "wall_ms_per_step": round(step_ms, 3),
                   # above wall_ms_per_step when kernels of several streams overlapped (NCCL beside compute)
                   "kernel_ms_per_step": round(sum(r["us_per_step"] for r in rows) / 1e3, 3),
                   "breakdown": kernel_breakdown(rows, step_ms), "top": rows[:TOP_KERNELS], "trace": trace.name}
        (self.out_dir / f"{name}.summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def abandon(self) -> None:
        """The loop failed inside the window: stop tracing, write nothing (the device may be what failed)."""
        profiler, self.profiler, self.done = self.profiler, None, True
        if profiler is not None:
            try:
                profiler.stop()
            except Exception as exc:  # noqa: BLE001  # the loop's own error is the one to report
                logger.warning("stopping the profiler after the loop failed: %s", exc)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def profiler_rows(profiler: torch.profiler.profile, steps: int, on_gpu: bool) -> list[dict[str, Any]]:
    """Time per kernel (GPU) or per operator's self time (CPU) and calls, per step, longest first."""
    rows = []
    for average in profiler.key_averages():
        if on_gpu:
            us = getattr(average, "device_time_total", None) or getattr(average, "cuda_time_total", 0)
        else:
            us = average.self_cpu_time_total
        if us > 0:  # the category from the whole name: a CUTLASS kernel's element types come late in it
            rows.append({"kernel": average.key[:160], "category": category_of(average.key),
                         "us_per_step": round(us / steps, 2), "calls_per_step": round(average.count / steps, 2)})
    rows.sort(key=lambda row: -row["us_per_step"])
    return rows
