"""Shared helpers for the GPU benchmarks: timing, environment record, JSON output, time budgets.

Timing: warm up first, take medians of CUDA-event timings (triton.testing.do_bench, or CUDA-graph replays for
kernels shorter than their Python launch), compare ratios measured in one run on one GPU. On CPU (smoke runs) a
host clock is used. write_result is the one format of benchmarks/results/<name>.json (benchmarks/run_suite.py).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from orchestration.observability.kernel_profile import category_of


def bench_ms(fn, warmup_ms: float = 50.0, rep_ms: float = 200.0) -> float:
    """Median milliseconds of fn() (fn must enqueue all its device work)."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bandwidth_row(rows: list, name: str, fn, traffic_bytes: int, reps: int, width: int = 58) -> dict:
    """One row of a kernel-alone table: the device time per call of fn (graph_ms: 10 calls in one CUDA graph, median
    of `reps` replays; back_to_back_ms where fn cannot be captured), with GB/s against `traffic_bytes` (the op's least
    traffic); appended to `rows` and printed. Timed by Python launches, a kernel of < ~0.15 ms reads as the host's
    launch time (an fp8 transpose tile sweep timed that way put most tiles on one 0.15 ms floor); a graph replays
    without the host."""
    fn()
    torch.cuda.synchronize()
    try:
        ms, timing = graph_ms(fn, calls=10, replays=reps), "cuda_graph"
    except Exception as exc:  # noqa: BLE001  # some ops cannot be captured: time them launched, and say so
        print(f"  ({name}: graph capture failed, {type(exc).__name__}: {str(exc)[:100]}; timed back to back)")
        torch.cuda.synchronize()
        ms, timing = statistics.median(back_to_back_ms(fn, calls=10) for _ in range(reps)), "back_to_back"
    row = {"case": name, "ms": round(ms, 4), "GBps": round(traffic_bytes / ms / 1e6, 1), "timing": timing}
    rows.append(row)
    print(f"{name:{width}s} {ms:8.4f} ms {row['GBps']:8.1f} GB/s", flush=True)
    return row


def graph_ms(fn, calls: int = 10, replays: int = 7) -> float:
    """Device milliseconds per call of fn: `calls` calls captured in one CUDA graph, the median over `replays` replays
    timed by CUDA events. No host launch time is in it, so it is the kernel's own time even where the host launches
    slower than the kernel runs. fn is run twice on a side stream first (warm-up and lazy initialisation, which
    capture forbids)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def back_to_back_ms(fn, calls: int) -> float:
    """Milliseconds per call of `calls` calls of fn() queued back to back between two CUDA events: the device time of
    a kernel whose launch (host) takes less than its run. Timed one call at a time (cuda_event_ms), a Python-launched
    Triton kernel of ~0.2 ms read as 0.5-1.0 ms: the events also caught the host's launch work."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def cuda_event_ms(fn, reps: int) -> float:
    """Median milliseconds of `reps` calls of fn(), each timed alone between two CUDA events (no warm-up)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"


def env_info() -> dict:
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "device": device_name(),
        "python": sys.version.split()[0],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001  # torchao is optional: record why it is missing
        info["torchao"] = f"unavailable: {type(e).__name__}: {e}"
    return info



def run_own_session(cmd: list[str], log_path: str | os.PathLike, timeout_s: float, cwd) -> tuple[int | str, float]:
    """Run cmd with stdout and stderr into log_path, in a process session of its own so that on a timeout the
    launcher and every worker it started are killed together (a leftover worker would hold the GPU and slow the next
    run). Returns (return code, or "timeout"; wall seconds)."""
    import signal

    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, time.time() - t0

def write_json(path: str | os.PathLike, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


RESULT_KEYS = ("benchmark", "suite", "gpu", "torch", "triton", "torchao", "cuda", "python", "date_utc", "command",
               "suite_command", "returncode", "wall_s", "results")


def write_result(path: str | os.PathLike, *, benchmark: str, suite: str, command: str, suite_command: str,
                 returncode: int | str, wall_s: float, results, output_tail: str | None = None) -> Path:
    """Write benchmarks/results/<benchmark>.json: what ran (command, the runner's command), where (GPU name or
    None on a machine without one, torch/triton/torchao/CUDA/Python versions), when (UTC) and the program's own
    JSON under "results" (None when it wrote none; then output_tail holds the end of its output). Replaces the
    previous file: the history of a figure is in git."""
    env = env_info()
    record = {
        "benchmark": benchmark,
        "suite": suite,
        "gpu": env["device"] if torch.cuda.is_available() else None,
        "torch": env["torch"],
        "triton": env["triton"],
        "torchao": env["torchao"],
        "cuda": env["cuda"],
        "python": env["python"],
        "date_utc": env["time_utc"],
        "command": command,
        "suite_command": suite_command,
        "returncode": returncode,
        "wall_s": round(wall_s, 1),
        "results": results,
    }
    if output_tail is not None:
        record["output_tail"] = output_tail
    path = Path(path)
    write_json(path, record)
    return path


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of x against ref (computed in float64)."""
    ref64, x64 = ref.detach().double(), x.detach().double()
    noise = (x64 - ref64).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref64.norm() / noise))


class Budget:
    """Wall-clock budget: benchmarks stop starting new cases once it is spent (and record the skips)."""

    def __init__(self, seconds: float):
        self.t0 = time.time()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)

    def elapsed(self) -> float:
        return time.time() - self.t0


def run_workers(script: str, args: list[str], n: int, timeout_s: float) -> list[int]:
    """Start n copies of `script --worker i --nworkers n` in parallel (compile-cache warmers); wait."""
    # Few inductor compile threads each: n processes already run in parallel.
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 2) // n)))
    procs = [
        subprocess.Popen([sys.executable, script, *args, "--worker", str(i), "--nworkers", str(n)], env=env)
        for i in range(n)
    ]
    deadline = time.time() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(-9)
    return codes


def kernel_times(step, steps: int = 1, name_chars: int = 120) -> list[dict]:
    """GPU time per kernel name over `steps` calls of step() (torch.profiler), longest first:
    [{"kernel", "us_per_step", "calls_per_step"}]."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": ev.key[:name_chars], "category": category_of(ev.key), "us_per_step": t / steps,
                         "calls_per_step": ev.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows
