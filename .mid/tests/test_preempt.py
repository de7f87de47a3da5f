"""SIGTERM (what Kubernetes, Slurm and spot reclaimers send) saves a checkpoint at the next step boundary, agreed by
all ranks in the step's one collective, then the run stops; the next start resumes from that checkpoint with no
step lost. Through Ray (SIGTERM to launch.py's driver, forwarded to the workers through the run directory) and
through torchrun (which forwards its SIGTERM to every rank). Checkpoints are due only every 1000 steps here, so the
saved step is the signal's, not a periodic one. Each test prints the time from the signal to the saved checkpoint
(docs/reliability.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestration.observability.events import read_jsonl
from tests.conftest import REPO, launch
from tests.test_hardening_ray import kill_tree, process_tree, start, wait_for_step

pytestmark = pytest.mark.slow

SETTINGS = ["model=debug_dense", "logging.wandb=false", "logging.ray_metrics=false", "train.log_every=1",
            "checkpoint.every_steps=1000", "train.warmup_steps=2"]


def check_preempted_run(run_dir: Path, t_signal: float, step_at_signal: int) -> tuple[int, float]:
    """The run stopped as preempted with a checkpoint of its last step: the step in flight at the signal, or the
    next one when the signal came after that step had read its request.
    Returns (that step, seconds from the signal to the checkpoint_saved event)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    final = json.loads((run_dir / "final_state.json").read_text())
    assert summary["status"] == "preempted" and final["status"] == "preempted", summary
    events = read_jsonl(run_dir / "events.jsonl")
    preempted = [e for e in events if e["event"] == "preempted"]
    saved = [e for e in events if e["event"] == "checkpoint_saved" and e["time"] >= t_signal]
    assert len(preempted) == 1 and len(saved) == 1, [e["event"] for e in events]
    stopped_at = preempted[0]["step"]
    assert saved[0]["step"] == stopped_at == final["step"] == summary["final_step"]
    assert 0 <= stopped_at - step_at_signal <= 2, (step_at_signal, stopped_at)
    assert (run_dir / "checkpoints" / f"step_{stopped_at:06d}").is_dir()
    return stopped_at, saved[0]["time"] - t_signal


def check_resumed_without_loss(run_dir: Path, stopped_at: int) -> None:
    resumes = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumes and resumes[-1]["from_step"] == stopped_at, resumes  # 0 steps trained again
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, stopped_at + 3)), steps  # each step once


def test_sigterm_to_the_driver_saves_at_the_next_step_and_the_next_start_loses_nothing(tmp_path, isolated_env,
                                                                                        no_ray_leftovers):
    root = tmp_path / "runs"
    run_dir = root / "term"
    proc = start(isolated_env, root, "term", *SETTINGS, "train.steps=100000")
    out, step_at_signal, t_signal = sigterm_after_step(proc, run_dir, 4, timeout=120)
    assert proc.returncode == 1, out[-3000:]  # not completed
    assert "SIGTERM: the workers save a checkpoint at their next step" in out, out[-3000:]
    stopped_at, save_s = check_preempted_run(run_dir, t_signal, step_at_signal)
    print(f"Ray: checkpoint of step {stopped_at} saved {save_s:.2f} s after SIGTERM (at step {step_at_signal})")

    done = launch(isolated_env, f"run_root={root}", "run_name=term", *SETTINGS, f"train.steps={stopped_at + 2}",
                  timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_resumed_without_loss(run_dir, stopped_at)


def sigterm_after_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> tuple[str, int, float]:
    """SIGTERM to the launcher once the run logged `step`; its output, the last logged step and the signal's time.
    Whatever of the job is still running afterwards is killed."""
    try:
        wait_for_step(run_dir, step, proc)
        step_at_signal = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
        t_signal = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(process_tree(proc.pid))
    return out, step_at_signal, t_signal


def torchrun(run_root: Path, env: dict, *overrides: str, nproc: int = 2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             "-m", "orchestration.driver.torchrun", f"run_root={run_root}", "run_name=term",
                             *SETTINGS, *overrides], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_sigterm_to_torchrun_saves_at_the_next_step_and_the_next_start_loses_nothing(tmp_path, isolated_env):
    """torchrun forwards SIGTERM to both ranks (their own handlers): the same save and stop, then a resume that
    loses nothing. (torchrun's agent itself still prints its SignalException.)"""
    root = tmp_path / "runs"
    run_dir = root / "term"
    proc = torchrun(root, isolated_env, "train.steps=100000")
    out, step_at_signal, t_signal = sigterm_after_step(proc, run_dir, 4, timeout=60)
    stopped_at, save_s = check_preempted_run(run_dir, t_signal, step_at_signal)
    print(f"torchrun: checkpoint of step {stopped_at} saved {save_s:.2f} s after SIGTERM (at step {step_at_signal})")

    resumed = torchrun(root, isolated_env, f"train.steps={stopped_at + 2}")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    check_resumed_without_loss(run_dir, stopped_at)
