"""Elastic training on an autoscaled multi-node Ray cluster on this machine (orchestration/driver/autoscale_local.py):
the autoscaler adds a node and the run grows onto it, a node leaves with notice (0 steps lost) and one without (no
replacement: the run shrinks); and a worker crash. Both on a corpus prepared by the product's own commands, so one
uninterrupted reference run serves both. Each run must finish its steps, consume every sample exactly once, and end at
the same loss as an uninterrupted run.

The model is a small DeepSeek-MoE with train.expert_parallel=2, so a resize changes the parallel layout (chosen at
every (re)start by orchestration.training.elastic.plan_layout): at 2 workers FSDP with the routed experts split over
both, at 1 worker one worker holding every expert. Each grow and shrink loads the checkpoint into the other layout.

Tolerance on the final loss: these runs train in float32 (precision=bf16 with compute_dtype=float32, so no
rounding to low precision hides or creates differences); the only differences between an interrupted and an
uninterrupted run are summation orders: the gradients summed across 1 or 2 workers, and under expert parallelism an
expert's weight gradient taken over both workers' tokens in one GEMM instead of one micro-batch at a time, a last-bit
change per step. 1e-3 absolute on a loss near 3 still catches any replayed or skipped batch (which moves the loss by
1e-2 or more at this stage). What bounds the steps: such a last-bit difference eventually flips a routing decision
at a near tie, and from then on the two trajectories part by more than summation order, slowly at first
(docs/reliability.md has the measurement): STEPS is short enough that a late flip stays inside the tolerance.
"""

import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from orchestration.driver.autoscale_local import wait_until
from orchestration.observability import dashboard as dash
from orchestration.observability.events import read_jsonl
from tests.conftest import REPO, launch, launch_env

pytestmark = pytest.mark.slow

# Enough steps that the run is still going when the last departure's group starts (docs/reliability.md has the
# timeline), few enough that a flipped routing decision has no time to part the trajectories beyond LOSS_TOL (the
# module's docstring).
STEPS = 200
GLOBAL_BATCH = 16
# debug_moe: 8 routed experts, so expert parallelism 2 at 2 workers; 1 worker runs without it.
MOE_EP2 = ["model=debug_moe", "train.sharding=fsdp", "train.expert_parallel=2"]
COMMON = [*MOE_EP2, "precision=bf16", "precision.compute_dtype=float32", f"train.steps={STEPS}",
          f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=8", "data.seq_len=128",
          "train.warmup_steps=10", "train.log_every=1", "checkpoint.every_steps=20", "logging.wandb=false",
          "logging.progress_every_s=10", "monitor=off"]
# Monitors off: these tests compare trajectories to 1e-3, and a detector decision at a borderline value could
# differ between two runs whose gradients differ in the last bit (monitored runs: tests/test_divergence_e2e.py).
LOSS_TOL = 1e-3




def _uninterrupted_loss(tmp: Path, *extra: str) -> float:
    """The same job without interruption, on the embedded 2-worker cluster."""
    proc = launch(_env(tmp), *COMMON, *extra, f"run_root={tmp}", "run_name=ref", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp / "ref" / "summary.json").read_text())
    assert summary["final_step"] == STEPS and summary["consumed_ranges"] == [[0, STEPS * GLOBAL_BATCH]]
    return summary["final_loss"]


@pytest.fixture(scope="module")
def tokenized_data(tmp_path_factory) -> list[str]:
    """Overrides of a corpus prepared by the product's commands: a 512-entry BPE trained here on seven standard
    library packages (1.03 M training tokens, more than the 200 x 16 x 129 a run reads; 83 k validation tokens)."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = [str(stdlib / name) for name in ("json", "email", "logging", "importlib", "asyncio", "unittest", "xml")]
    for module, *args in (("orchestration.data.train_tokenizer", "--vocab-size", "512", "--out",
                           str(root / "tokenizer.json")),
                          ("orchestration.data.prepare", "--tokenizer", str(root / "tokenizer.json"), "--out",
                           str(root / "corpus"), "--val-fraction", "0.1", "--workers", "2")):
        proc = subprocess.run([sys.executable, "-m", module, "--input", *inputs, *args], capture_output=True,
                              text=True, timeout=300, cwd=REPO, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return ["data=tokenized", f"data.path={root / 'corpus'}"]


@pytest.fixture(scope="module")
def tokenized_reference_loss(tmp_path_factory, tokenized_data):
    return _uninterrupted_loss(tmp_path_factory.mktemp("tokenized_reference"), *tokenized_data)


def _env(tmp: Path) -> dict:
    """W&B off: these runs compare losses and events, not W&B records."""
    return launch_env(tmp, WANDB_MODE="disabled")


def events_of(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def last_step(run_dir: Path) -> int:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return metrics[-1]["step"] if metrics else 0


def first_metrics_at(run_dir: Path, world_size: int, after: float) -> dict | None:
    """The first step logged at `world_size` after time `after` (the first step of a group is always logged)."""
    return next((m for m in read_jsonl(run_dir / "metrics.jsonl")
                 if m["world_size"] == world_size and m["time"] > after), None)


# Its module fixtures (a corpus, a tokenizer, an uninterrupted run) count toward the first test's time.
@pytest.mark.timeout(1500)
def test_autoscaler_grows_the_run_and_a_drained_node_leaves_without_losing_a_step(tmp_path, tokenized_data,
                                                                                  tokenized_reference_loss):
    """An autoscaled cluster on this machine (orchestration/driver/autoscale_local.py: Ray's fake multi-node provider,
    autoscaler v2): the run starts on the on-demand node with 1 worker and asks for 2. Spot capacity appears: the
    autoscaler launches a spot node and the run grows onto it. That node then gets a preemption notice (a drain with
    a deadline): the workers save the step they are at and wait; at the deadline the node is killed, as a cloud does,
    and the run goes on from exactly that step (on 1 worker, or on 2 when the autoscaler's replacement for the
    draining node is up by then). The spot capacity then goes, and the spot node in use with it, without notice
    (SIGKILL): the run resumes from its newest checkpoint on the on-demand node alone. Every group at 2 workers runs
    expert parallelism 2, every group at 1 worker none, so the grow and the last shrink both change the layout. Every
    sample once, the loss of an uninterrupted run, the figures printed (docs/reliability.md). (Lowering the spot
    capacity before a noticed departure would make the sizes known in advance, but autoscaler v2 then terminates the
    excess node at once: no notice the workers could act on.)"""
    from orchestration.driver.autoscale_local import ONDEMAND_TYPE, SPOT_TYPE, LocalAutoscalingCluster

    cluster = LocalAutoscalingCluster(tmp_path / "cluster", spot_nodes=0, env=_env(tmp_path))
    driver = None
    figures: dict = {}
    run_dir = tmp_path / "elastic"
    def grow() -> tuple[dict, dict]:
        """Spot capacity for one node: returns the node and the first step at world size 2 after it was ready."""
        known = {n.node_id for n in cluster.nodes()}
        cluster.set_spot_nodes(1)
        node = wait_until(lambda: [n for n in cluster.alive(SPOT_TYPE) if n.node_id not in known], 180,
                        "the autoscaler to launch a spot node")[0]
        return node, wait_until(lambda: first_metrics_at(run_dir, 2, node.start_time_s), 240, "a step at world size 2")

    try:
        cluster.start()
        wait_until(lambda: cluster.alive(ONDEMAND_TYPE), 240, "the on-demand node")
        args = [sys.executable, str(REPO / "launch.py"), *COMMON, *tokenized_data, f"run_root={tmp_path}",
                "run_name=elastic", f"cluster.address={cluster.address}", "cluster.min_workers=1",
                "cluster.max_workers=2", "cluster.worker_group_start_timeout_s=30",
                "cluster.elastic_resize_interval_s=10", "cluster.max_failures=10"]
        log = open(tmp_path / "driver.log", "w")  # noqa: SIM115  # the driver subprocess writes it until it is reaped
        driver = subprocess.Popen(args, cwd=REPO, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: last_step(run_dir) >= 5, 300, "5 steps on the on-demand node")

        # Grow: the run's request for 2 workers is at the autoscaler; spot capacity appears.
        spot, grown = grow()
        figures["node_ready_to_first_step_s"] = round(grown["time"] - spot.start_time_s, 1)

        # Notice: a drain with a deadline; the node is killed at the deadline, as the cloud would.
        wait_until(lambda: last_step(run_dir) >= grown["step"] + 5, 120, "5 steps at world size 2")
        deadline_s = 10
        t_notice = time.time()
        cluster.drain(spot.node_id, deadline_s)
        leaving = wait_until(lambda: events_of(run_dir, "node_leaving"), 60, "the workers to act on the notice")[0]
        assert leaving["nodes"] == [spot.node_id]
        saved = [e for e in events_of(run_dir, "checkpoint_saved") if e["step"] == leaving["step"]]
        assert saved and saved[-1]["time"] > t_notice, (leaving, saved)
        figures["notice_to_checkpoint_s"] = round(saved[-1]["time"] - t_notice, 2)
        time.sleep(max(0.0, t_notice + deadline_s - time.time()))
        cluster.kill_node(spot.node_id)
        shrunk = wait_until(lambda: [e for e in events_of(run_dir, "resume") if e["time"] > t_notice], 240,
                          "a resume after the notice")[0]
        # 0 steps lost: the group after the notice starts at the step the workers saved, and none trained beyond it.
        assert shrunk["from_step"] == leaving["step"], (shrunk, leaving)
        before = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["time"] < shrunk["time"]]
        assert max(before) == leaving["step"], (max(before), leaving)
        first_after = wait_until(lambda: first_metrics_at(run_dir, shrunk["world_size"], shrunk["time"]), 120,
                               "a step after it")
        figures["notice_to_first_step_after_s"] = round(first_after["time"] - t_notice, 1)
        figures["world_size_after_notice"] = shrunk["world_size"]

        # A departure without notice of the spot node the run uses (the replacement: at 2 workers again), with no
        # spot capacity left to replace it: the run shrinks to the on-demand node.
        regrown = wait_until(lambda: first_metrics_at(run_dir, 2, shrunk["time"] - 1), 300, "world size 2 again")
        spot2 = next(n for n in cluster.alive(SPOT_TYPE) if n.node_id != spot.node_id)
        wait_until(lambda: last_step(run_dir) >= regrown["step"] + 5, 120, "5 steps at world size 2")
        t_kill, step_at_kill = time.time(), last_step(run_dir)
        cluster.set_spot_nodes(0)
        cluster.kill_node(spot2.node_id)
        lost = wait_until(lambda: [e for e in events_of(run_dir, "resume") if e["time"] > t_kill], 240,
                        "a resume after the kill")[0]
        newest = max(e["step"] for e in events_of(run_dir, "checkpoint_saved") if e["time"] < t_kill)
        assert lost["from_step"] == newest, (lost, newest)  # the newest checkpoint
        assert lost["world_size"] == 1, lost
        first_after_kill = wait_until(lambda: first_metrics_at(run_dir, lost["world_size"], lost["time"]), 120,
                                    "a step after the kill")
        figures["kill_to_first_step_after_s"] = round(first_after_kill["time"] - t_kill, 1)
        figures["steps_trained_again_after_the_kill"] = step_at_kill - lost["from_step"]
        assert driver.wait(timeout=900) == 0, (tmp_path / "driver.log").read_text()[-3000:]
        # Ray Train's state actor is detached: the Train view still lists the run after its driver exited.
        train_run = dash.find_run(dash.train_runs(cluster.dashboard_url), "elastic")
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        cluster.stop()

    summary = json.loads((run_dir / "summary.json").read_text())
    figures["wall_time_s"] = summary["wall_time_s"]
    print("autoscaling figures:", json.dumps(figures))
    (tmp_path / "autoscale_figures.json").write_text(json.dumps(figures, indent=2))
    assert figures["node_ready_to_first_step_s"] <= 90, figures
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    assert summary["world_sizes_seen"] == [1, 2] and summary["restarts"] >= 3
    # Exactly the samples 0..N-1, once each: no batch skipped, none replayed into the kept trajectory.
    assert summary["consumed_ranges"] == [[0, STEPS * GLOBAL_BATCH]]
    assert summary["samples_consumed"] == STEPS * GLOBAL_BATCH
    assert abs(summary["final_loss"] - tokenized_reference_loss) < LOSS_TOL, (summary["final_loss"],
                                                                               tokenized_reference_loss)
    assert all(t["checkpoint_load_s"] < 10 for t in summary["restart_timings"]), summary["restart_timings"]

    # The layout each worker group ran: expert parallelism at 2 workers, none at 1; the first group had 1 worker,
    # the second 2 (the grow), the last 1 again (the shrink).
    groups = [(e["world_size"], e["layout"]) for e in events_of(run_dir, "worker_group_start")
              if e.get("worker_rank", 0) == 0]
    layouts = {1: "one worker", 2: "FSDP over 2, experts over 2"}
    assert all(layout == layouts[size] for size, layout in groups), groups
    assert [size for size, _ in groups][:2] == [1, 2] and groups[-1][0] == 1, groups
    # The all-to-alls' bytes (metrics.jsonl a2a_bytes_per_step): sent at 2 workers, no all-to-all at 1.
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert all(m["a2a_bytes_per_step"] > 0 for m in metrics if m["world_size"] == 2), metrics[-1]
    assert not any("a2a_bytes_per_step" in m for m in metrics if m["world_size"] == 1)

    # The Train view: one attempt per worker group: 1 worker, then 2 after the grow, then one per departure.
    assert train_run is not None and train_run["status"] == "FINISHED"
    attempts = dash.attempts(train_run)
    sizes = [a.world_size for a in attempts if a.world_size]  # an attempt that never got its workers lists none
    assert sizes[:2] == [1, 2] and len(sizes) >= summary["restarts"] + 1, sizes
    assert attempts[-1].status == "FINISHED"


def test_worker_crash_restarts_from_checkpoint(tmp_path, tokenized_data, tokenized_reference_loss):
    env = _env(tmp_path)
    proc = launch(env, *COMMON, *tokenized_data, f"run_root={tmp_path}", "run_name=crash", "faults=crash",
                  "faults.rank=1",
                  "faults.step=50", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "crash"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    assert summary["restarts"] == 1 and summary["world_sizes_seen"] == [2]
    resume = events_of(run_dir, "resume")
    assert len(resume) == 1 and resume[0]["from_step"] == 40  # the checkpoint before the crash at step 50
    assert summary["consumed_ranges"] == [[0, STEPS * GLOBAL_BATCH]]
    # Same world size before and after the crash, so the same summation order: the resumed trajectory is the
    # uninterrupted one bit for bit (the model, optimizer, scheduler, data cursor and RNG all come from the
    # checkpoint), not merely within LOSS_TOL.
    assert summary["final_loss"] == tokenized_reference_loss, (summary["final_loss"], tokenized_reference_loss)
