"""The embedded Ray cluster of a SIGKILLed driver does not outlive the next start of the run: the driver records its
cluster's processes (pid and start time) in the run directory, and the next start ends those still running, by pid
(orchestration/driver/leftovers.py). Also: the dead driver's run lease does not block that start."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from orchestration.driver.run_lock import process_start_ticks
from orchestration.observability.events import read_jsonl
from tests.conftest import launch
from tests.test_hardening_ray import kill_tree, process_tree, start, wait_for_step

pytestmark = pytest.mark.slow

SETTINGS = ["model=debug_dense", "logging.wandb=false", "logging.ray_metrics=false", "train.log_every=1",
            "checkpoint.every_steps=2", "train.warmup_steps=2"]


def test_next_start_ends_the_ray_processes_a_killed_driver_left(tmp_path, isolated_env, no_ray_leftovers):
    root = tmp_path / "runs"
    run_dir = root / "left"
    proc = start(isolated_env, root, "left", *SETTINGS, "train.steps=100000")
    tree: list[int] = []
    try:
        wait_for_step(run_dir, 2, proc)
        time.sleep(6)  # one refresh of the record after the workers started (RayProcessRecord.every_s)
        tree = process_tree(proc.pid)[1:]
        recorded = json.loads((run_dir / "ray_processes.json").read_text())["processes"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        time.sleep(1)
        left = {p["pid"] for p in recorded if process_start_ticks(p["pid"]) == p["start"]}
        names = [p["cmd"] for p in recorded if p["pid"] in left]
        # They outlive it: the raylet's agents (started after ray.init returned) run on long after the rest exited.
        agents = {p["pid"] for p in recorded if p["cmd"].strip() in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")}
        assert len(agents) == 2 and agents <= left, names

        last = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
        done = launch(isolated_env, f"run_root={root}", "run_name=left", *SETTINGS, f"train.steps={last + 2}",
                      timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        ended = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "ray_leftovers_ended"]
        assert len(ended) == 1 and agents <= set(ended[0]["pids"]) <= left, (ended, left)
        assert not [pid for pid in left if process_start_ticks(pid) is not None]
        assert not (run_dir / "ray_processes.json").exists()  # the completed start removed its own record
    finally:
        kill_tree(tree)
        if proc.poll() is None:
            kill_tree(process_tree(proc.pid))
