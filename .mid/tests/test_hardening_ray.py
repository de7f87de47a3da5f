"""Faults of the whole job on a real embedded Ray cluster: a full disk (a real size-limited tmpfs), Ctrl-C, a killed
driver, the processes its embedded cluster left and the resumes after them, and what the cluster exposes on the
network (the listening sockets of every process of the job, read from /proc). Slow: ~3 minutes in all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestration.driver.run_lock import process_start_ticks
from orchestration.observability.events import read_jsonl
from tests.conftest import REPO, launch, ray_services_still_up, size_limited_tmpfs

pytestmark = pytest.mark.slow

DENSE = ["model=debug_dense", "logging.wandb=false", "train.log_every=1", "checkpoint.every_steps=5"]


# -- helpers: real mounts, real process trees, real sockets ------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 14 MiB tmpfs (debug_dense checkpoints are 5.53 MB: two fit, a third does not); unmounted afterwards."""
    with size_limited_tmpfs(tmp_path / "disk", "14m") as mount:
        yield mount


def process_tree(root_pid: int) -> list[int]:
    """root_pid and all its descendants, from /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _listening_inodes() -> dict[int, tuple[str, int]]:
    import ipaddress

    found = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints each 32-bit word in host (little-endian) order
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found[int(fields[9])] = (str(ipaddress.ip_address(packed)), int(hex_port, 16))
    return found


def listening_sockets(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening TCP socket the processes hold."""
    inodes = _listening_inodes()
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            name = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:60]
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                out.add((pid, name, *inodes[int(target[8:-1])]))
    return sorted(out)


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return ""


def kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(env: dict, run_root: Path, run_name: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run_root={run_root}", f"run_name={run_name}",
                             *overrides], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        if metrics and metrics[-1]["step"] >= step:
            return metrics[-1]["step"]
        time.sleep(0.2)
    if proc.poll() is None:  # still running: end it, so that its output so far can be read and shown
        kill_tree(process_tree(proc.pid))
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired as exc:  # a process outside the tree still holds the pipe
        out = (exc.output or b"").decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
    raise AssertionError(f"step {step} not reached in {timeout:.0f} s (exit code {proc.returncode}); output: "
                         f"{out[-3000:]}")


# -- the tests ----------------------------------------------------------------------------------------------------


def test_disk_full_fails_once_with_its_cause_and_keeps_the_last_checkpoint(small_disk, isolated_env,
                                                                           no_ray_leftovers,
                                                                           another_ray_instance_on_the_host):
    """...and with another Ray cluster on the host: Ray Train's PlacementGroupCleaner then failed its controller
    checks with "Found multiple active Ray instances" (a traceback in the console) until the workers were pointed
    at their own cluster (orchestration/driver/ray_logs.py)."""
    run_dir = small_disk / "full"
    t0 = time.time()
    proc = launch(isolated_env, f"run_root={small_disk}", "run_name=full", *DENSE, "train.steps=40", timeout=400)
    wall_s = time.time() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    # The preflight saw that three checkpoints (keep_last) and the next one do not fit in 14 MiB.
    assert "free on" in out and "checkpoint needs" in out, out[-4000:]
    assert f"no space left on {small_disk}" in out and "or point run_root elsewhere" in out, out[-4000:]
    assert "Error executing job" not in out and "Traceback" not in proc.stderr, out[-6000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    events = read_jsonl(run_dir / "events.jsonl")
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["checkpoint_step"] == 10 and failed[0]["out_of_space"], failed
    assert "No space left on device" in failed[0]["error"]
    names = [e["event"] for e in events]
    assert names.count("worker_group_start") == 1 and "worker_lost" not in names  # not retried as a lost worker

    from orchestration.checkpoint.directory import verify_checkpoint

    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000000", "step_000005"]  # no partial left
    assert verify_checkpoint(checkpoints / "step_000005").step == 5
    # Ray kept no second copy of any checkpoint in its storage (run_root/_ray).
    assert not list((small_disk / "_ray").rglob("checkpoint_*")), list((small_disk / "_ray").rglob("*"))
    print(f"disk full: failed run ended in {wall_s:.1f} s, summary written, step 5 intact")


def test_preflight_refuses_a_disk_that_cannot_hold_one_checkpoint(tmp_path, isolated_env):
    with size_limited_tmpfs(tmp_path / "tiny", "2m") as mount:
        refused = launch(isolated_env, f"run_root={mount}", "run_name=tiny", *DENSE, "train.steps=10", timeout=120)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "checkpoint needs" in refused.stderr and "point run_root elsewhere" in refused.stderr
    assert "Ray dashboard" not in refused.stdout


def test_ctrl_c_killed_driver_and_resumes(tmp_path, isolated_env, no_ray_leftovers):
    """Ctrl-C stops the workers at a step boundary within seconds, without a traceback, and leaves no Ray process;
    a resumed start whose driver is then SIGKILLed leaves its embedded cluster's agents running, and the next start
    ends them by pid (orchestration/driver/leftovers.py; the dead driver's run lease does not block it) and resumes;
    the run directory counts both as resumes, never as lost workers, and holds each step's metrics once. The
    embedded cluster's listening sockets are read while it trains. One run for all of it: each start of a run costs
    a Ray cluster and a worker group."""
    root = tmp_path / "runs"
    run_dir = root / "cc"
    env = {k: v for k, v in isolated_env.items() if k != "RAY_AUTH_MODE"}  # the product's default auth

    # 1. Ctrl-C.
    proc = start(env, root, "cc", *DENSE, "train.steps=100000")
    try:
        wait_for_step(run_dir, 7, proc)
        sockets = listening_sockets(process_tree(proc.pid))
        checkpoints_before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        step_at_signal = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
        t_signal = time.time()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        exit_s = time.time() - t_signal
    finally:
        if proc.poll() is None:
            kill_tree(process_tree(proc.pid))
    assert proc.returncode == 1, out[-3000:]
    assert exit_s < 10, (exit_s, out[-3000:])
    last_step = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
    assert last_step - step_at_signal <= 2, (step_at_signal, last_step)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints_before
    assert "Traceback" not in out and "PlacementGroupCleaner" not in out, out[-3000:]
    assert "Interrupted" in out, out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    left = ray_services_still_up(env)  # the driver stopped the workers and its embedded cluster
    assert not left, f"Ray processes left behind by the interrupted start: {left}"
    exposed = [s for s in sockets if not _is_loopback(s[2])]
    print(f"Ctrl-C: exit {exit_s:.1f} s after the signal, {last_step - step_at_signal} step(s) after it")

    # 2. A resumed start whose driver alone is SIGKILLed mid-run (kill -9, the OOM killer).
    resumed_from = int(max(checkpoints_before)[5:])
    proc = start(env, root, "cc", *DENSE, "train.steps=100000")
    tree: dict[int, int | None] = {}  # pid -> start time: a pid reused since is not ours to kill
    try:
        wait_for_step(run_dir, last_step + 3, proc)
        time.sleep(6)  # one refresh of the record after the workers started (RayProcessRecord.every_s)
        tree = {pid: process_start_ticks(pid) for pid in process_tree(proc.pid)[1:]}
        workers = {pid: start for pid, start in tree.items() if command(pid).startswith("ray::RayTrainWorker")}
        recorded = json.loads((run_dir / "ray_processes.json").read_text())["processes"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        # Ray ends the dead driver's workers: wait for that, so that no step of theirs lands after killed_at.
        deadline = time.time() + 30
        while any(process_start_ticks(pid) == start for pid, start in workers.items()) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        left = {p["pid"] for p in recorded if process_start_ticks(p["pid"]) == p["start"]}
        names = [p["cmd"] for p in recorded if p["pid"] in left]
        # They outlive it: the raylet's agents (started after ray.init returned) run on long after the rest exited.
        agents = {p["pid"] for p in recorded if p["cmd"].strip() in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")}
        assert len(agents) == 2 and agents <= left, names
        killed_at = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]

        # 3. Resume to the end: the start ends what the killed one left, then trains.
        final_steps = killed_at + 4
        t_resume = time.time()
        done = launch(env, f"run_root={root}", "run_name=cc", *DENSE, f"train.steps={final_steps}", timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        kill_tree([pid for pid, start in tree.items() if start is not None and process_start_ticks(pid) == start])
        if proc.poll() is None:
            kill_tree(process_tree(proc.pid))
    events = read_jsonl(run_dir / "events.jsonl")
    ended = [e for e in events if e["event"] == "ray_leftovers_ended"]
    assert len(ended) == 1 and agents <= set(ended[0]["pids"]) <= left, (ended, left)
    assert not [pid for pid in left if process_start_ticks(pid) is not None]
    assert not (run_dir / "ray_processes.json").exists()  # the completed start removed its own record
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 2 and resumes[0]["from_step"] == resumed_from, resumes
    assert all(e["origin"] == "new_start" for e in resumes), resumes
    assert "worker_lost" not in [e["event"] for e in events]
    restart_s = resumes[-1]["time"] - t_resume
    progress = [int(line.split()[2].split("/")[0]) for line in done.stdout.splitlines()
                if line.startswith("[progress]")]
    assert progress and min(progress) > resumes[-1]["from_step"], progress  # nothing stale from the killed run
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, final_steps + 1)), steps  # each step once: the killed runs' extra lines dropped
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 0 and summary["resumes"] == 2, summary
    assert "skipped steps" in done.stdout
    print(f"killed driver: resumed start reached its first step {restart_s:.1f} s after launch")

    # Network: the embedded cluster runs with 127.0.0.1 as its node address, so GCS, raylet, the dashboard and
    # runtime-env agents, every worker's gRPC server and the metrics exporters listen on loopback (before: 13
    # listeners on all interfaces or the routable address); the rank-0 worker's torch.distributed store listens on
    # the loopback MASTER_ADDR (keep_store_on_loopback; torch's own server listened on every interface), and gloo's
    # sockets on lo (GLOO_SOCKET_IFNAME). No listener of the job's process tree is reachable from another host.
    assert sockets and not exposed, exposed
    assert any(s[1].strip() == "ray::RayTrainWorker" for s in sockets), sockets  # the store and gloo were read


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, how a dual-stack socket bound to 127.0.0.1 shows
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)

