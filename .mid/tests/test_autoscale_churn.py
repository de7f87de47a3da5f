"""Churn: for CHURN_S (over ten minutes) spot nodes of an autoscaled cluster on this machine come and go at random
(seeded): the autoscaler launches them while the run asks for more workers; each then leaves either with notice (a
drain with a deadline, the node killed at the deadline) or without (SIGKILL). The run trains throughout and is then
stopped with SIGTERM. Every sample exactly once; no step trained twice after a noticed departure; goodput and each
recovery's time are printed and written to churn_figures.json (docs/reliability.md has the figures).

Part of `make test` (its longest test; docs/reliability.md has its run time); `make test-churn` runs it alone.
tests/test_elastic_e2e.py has a short case of the same events (a grow, a noticed departure, a grow back, a departure
without notice).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import pytest

from orchestration.driver.autoscale_local import ONDEMAND_TYPE, SPOT_TYPE, LocalAutoscalingCluster, wait_until
from orchestration.observability.events import read_jsonl
from tests.conftest import REPO
from tests.test_elastic_e2e import _env, events_of, last_step

pytestmark = pytest.mark.churn

CHURN_S = 660
SEED = 20261207
GLOBAL_BATCH = 16
SETTINGS = ["model=debug_dense", "precision=bf16", "precision.compute_dtype=float32", "train.steps=1000000",
            f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=8", "data.seq_len=128",
            "train.warmup_steps=10", "train.log_every=1", "checkpoint.every_steps=20", "logging.wandb=false",
            "logging.progress_every_s=30", "monitor=off", "cluster.min_workers=1", "cluster.max_workers=2",
            "cluster.worker_group_start_timeout_s=30", "cluster.elastic_resize_interval_s=10",
            "cluster.max_failures=40"]


def kept_steps(metrics: list[dict]) -> dict[int, dict]:
    """The record of each step that the final trajectory kept: a step trained again after a restart replaces the
    earlier one (pure)."""
    kept: dict[int, dict] = {}
    for m in metrics:
        for step in [s for s in kept if s >= m["step"]]:
            del kept[step]
        kept[m["step"]] = m
    return kept


@pytest.mark.timeout(CHURN_S + 900)
def test_nodes_join_and_leave_at_random_for_ten_minutes(tmp_path):
    rng = random.Random(SEED)
    # One spot node at a time: a 2-core machine runs 2 workers at most (docs/reliability.md says what was measured).
    cluster = LocalAutoscalingCluster(tmp_path / "cluster", spot_nodes=1, env=_env(tmp_path))
    run_dir = tmp_path / "churn"
    driver = None
    departures: list[dict] = []
    try:
        cluster.start()
        wait_until(lambda: cluster.alive(ONDEMAND_TYPE), 240, "the on-demand node")
        log = open(tmp_path / "driver.log", "w")  # noqa: SIM115  # the driver subprocess writes it until it is reaped
        driver = subprocess.Popen([sys.executable, str(REPO / "launch.py"), *SETTINGS, f"run_root={tmp_path}",
                                   "run_name=churn", f"cluster.address={cluster.address}"],
                                  cwd=REPO, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: last_step(run_dir) >= 1, 240, "the first step")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; the driver's output: {(tmp_path / 'driver.log').read_text()[-4000:]}") from exc
        t_start = time.time()
        while time.time() - t_start < CHURN_S:
            time.sleep(rng.uniform(30, 70))
            spot = cluster.alive(SPOT_TYPE)
            if not spot or last_step(run_dir) < 1:
                continue
            node = rng.choice(spot)
            noticed = rng.random() < 0.5
            event = {"time": time.time(), "node": node.node_id[-5:], "noticed": noticed, "step": last_step(run_dir)}
            if noticed:
                deadline_s = rng.randint(10, 20)
                event["deadline_s"] = deadline_s
                cluster.drain(node.node_id, deadline_s)
                time.sleep(max(0.0, event["time"] + deadline_s - time.time()))
            cluster.kill_node(node.node_id)
            departures.append(event)
        driver.send_signal(signal.SIGTERM)  # the driver's own stop: save at the next step, then end
        assert driver.wait(timeout=300) == 1, (tmp_path / "driver.log").read_text()[-3000:]  # 1: not completed
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        cluster.stop()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted"
    final = summary["final_step"]
    # Every sample once: the kept trajectory consumed exactly the first final x GLOBAL_BATCH samples.
    assert summary["consumed_ranges"] == [[0, final * GLOBAL_BATCH]]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    kept = kept_steps(metrics)
    assert sorted(kept) == list(range(1, final + 1))

    resumes = events_of(run_dir, "resume")
    leaving = events_of(run_dir, "node_leaving")
    recoveries = []
    for d in departures:
        # The first group that resumed after this departure, and its first step.
        resume = next((r for r in resumes if r["time"] > d["time"]), None)
        if resume is None:
            continue
        first = next((m for m in metrics if m["time"] > resume["time"]), None)
        record = {**d, "resumed_from": resume["from_step"], "world_size_after": resume["world_size"],
                  "departure_to_first_step_s": round(first["time"] - d["time"], 1) if first else None}
        notice = next((e for e in leaving if d["time"] <= e["time"] < resume["time"]), None)
        if d["noticed"] and notice is not None:
            # No step trained twice: the group after the notice starts at the saved step, and none went past it.
            assert resume["from_step"] == notice["step"], (d, notice, resume)
            trained_before = [m["step"] for m in metrics if m["time"] < resume["time"]]
            assert max(trained_before) == notice["step"], (d, notice)
            saved = [e for e in events_of(run_dir, "checkpoint_saved")
                     if e["step"] == notice["step"] and e["time"] >= d["time"]]
            record["notice_to_checkpoint_s"] = round(saved[0]["time"] - d["time"], 2)
            record["steps_trained_again"] = 0
        else:
            # metrics.jsonl keeps each step once (a restart drops the lines of steps trained again): the step the
            # run had reached at the departure tells what was trained again.
            record["steps_trained_again"] = max(0, d["step"] - resume["from_step"])
        recoveries.append(record)
    # A drained node that held no worker yet (the run had not grown onto it) leaves without the run noticing.
    noticed = [r for r in recoveries if "notice_to_checkpoint_s" in r]
    assert len(departures) >= 8 and len(noticed) >= 2 and any(not d["noticed"] for d in departures), departures

    first_step_time = metrics[0]["time"] - metrics[0]["step_time_s"]
    wall = metrics[-1]["time"] - first_step_time
    training = sum(m["step_time_s"] for m in kept.values())
    figures = {"wall_s": round(wall, 1), "kept_steps": final,
               "goodput": round(training / wall, 3), "world_sizes_seen": summary["world_sizes_seen"],
               "departures": len(departures), "noticed": len(noticed), "recoveries": recoveries}
    (tmp_path / "churn_figures.json").write_text(json.dumps(figures, indent=2))
    print("churn figures:", json.dumps(figures))
