"""One writer per run directory (orchestration/driver/run_lock.py): a second start of a running run is refused with
exit 2 naming the holder, before Ray and before anything of the run changes; a holder that died (SIGKILL, a lost
node) does not block the next start; of several starts racing for a stale lease exactly one wins. Real processes,
real files; the holder's liveness rules as a pure function."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestration.driver.run_lock import LOCK_FILE, Holder, RunLock, RunLocked, read_holder, this_host, why_gone
from tests.conftest import REPO, launch, repo_on_path

HOLD = """
import sys, time
from pathlib import Path
from orchestration.driver.run_lock import RunLock, RunLocked
try:
    lock = RunLock(Path(sys.argv[1]), heartbeat_s=float(sys.argv[2])).acquire()
except RunLocked as exc:
    print("refused", exc, flush=True)
    sys.exit(2)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
lock.release()
print("released", flush=True)
"""


def hold(run_path: Path, heartbeat_s: float = 10.0, seconds: float = 60.0) -> subprocess.Popen:
    """A process that takes the run's lease and holds it; returns once it holds it (or was refused)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_path), str(heartbeat_s), str(seconds)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=repo_on_path())
    first = proc.stdout.readline()
    assert first.startswith(("held", "refused")), first + proc.stderr.read()
    proc.first_line = first  # type: ignore[attr-defined]
    return proc


def tree_digest(root: Path) -> dict[str, str]:
    """Each file's sha256; a file gone between listing and reading (a holder's lease .tmp) is left out."""
    digests = {}
    for path in sorted(root.rglob("*")):
        try:
            digests[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
        except (FileNotFoundError, IsADirectoryError):
            continue
    return digests


def without_the_lease(digests: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in digests.items() if k != LOCK_FILE and not k.startswith(f".{LOCK_FILE}.")}


def foreign_holder(heartbeat_age_s: float, host: str = "node-elsewhere") -> Holder:
    now = time.time()
    return Holder(host=host, pid=4242, pid_start="1", boot_id="b", pid_namespace=1, started=now - 3600,
                  heartbeat=now - heartbeat_age_s, token="t-foreign")


def test_liveness_rules():
    here = {"host": "a", "pid": 1, "pid_start": "10", "boot_id": "boot1", "pid_namespace": 7}
    now = 1000.0
    same = Holder(host="a", pid=99, pid_start="5", boot_id="boot1", pid_namespace=7, started=900.0, heartbeat=999.0,
                  token="x")
    assert why_gone(same, now, here, 30.0, running=lambda pid, ticks: True) is None
    assert "pid 99 no longer runs on a" == why_gone(same, now, here, 30.0, running=lambda pid, ticks: False)
    rebooted = Holder(**{**same.__dict__, "boot_id": "boot0"})
    assert why_gone(rebooted, now, here, 30.0, running=lambda pid, ticks: True) == "its host rebooted since"
    # Another host (or another pid namespace of this host name): only the heartbeat tells; pids mean nothing there.
    for other in (Holder(**{**same.__dict__, "host": "b"}), Holder(**{**same.__dict__, "pid_namespace": 8})):
        assert why_gone(other, now, here, 30.0, running=lambda pid, ticks: False) is None
        old = Holder(**{**other.__dict__, "heartbeat": now - 31.0})
        assert why_gone(old, now, here, 30.0, running=lambda pid, ticks: True) == \
            "its heartbeat is 31 s old (stale after 30 s)"


def test_second_launch_is_refused_naming_the_holder_and_a_killed_holder_frees_the_run(tmp_path, isolated_env):
    """A live holder (another process of this host): launch.py exits 2 naming its host, pid and start time, before Ray
    starts, and no file of the run directory changed. SIGKILL the holder: the next start takes the run at once."""
    run_path = tmp_path / "runs" / "exp"
    run_path.mkdir(parents=True)
    (run_path / "events.jsonl").write_text('{"time": 1, "event": "run_start", "step": 0}\n')
    holder = hold(run_path)
    try:
        assert holder.first_line.startswith("held")
        before = tree_digest(run_path)
        lease_before = read_holder(run_path / LOCK_FILE)
        t0 = time.time()
        proc = launch(isolated_env, f"run_root={tmp_path / 'runs'}", "run_name=exp", "model=debug_dense",
                      "logging.wandb=false", timeout=120)
        elapsed = time.time() - t0
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("config error: run_name: run directory") and "is being written by another start" in line
        assert f"host {socket.gethostname()}, pid {holder.pid}, started " in line, line
        assert "Ray dashboard" not in proc.stdout and "Run directory" not in proc.stdout
        # The holder rewrites its lease each heartbeat (10 s; a loaded machine's refusal can take longer), through a
        # .run.lock.<token>.tmp file: the lease must still be the holder's own, whatever its heartbeat; every other
        # file must be byte-identical.
        assert without_the_lease(tree_digest(run_path)) == without_the_lease(before)
        lease_after = read_holder(run_path / LOCK_FILE)
        assert {**lease_after.__dict__, "heartbeat": None} == {**lease_before.__dict__, "heartbeat": None}
        print(f"refused in {elapsed:.1f} s (launch.py's imports included)")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    assert read_holder(run_path / LOCK_FILE).pid == holder.pid  # the dead holder's lease is still there
    successor = hold(run_path, seconds=0)
    assert successor.first_line.startswith("held"), successor.first_line
    assert successor.wait(timeout=30) == 0
    assert "Took over run directory" in successor.stderr.read()
    assert not (run_path / LOCK_FILE).exists()  # released at the end


def test_foreign_holder_blocks_until_its_heartbeat_is_stale_and_racing_starts_get_one_winner(tmp_path):
    run_path = tmp_path / "exp"
    run_path.mkdir()
    lease = run_path / LOCK_FILE
    lease.write_text(json.dumps(foreign_holder(heartbeat_age_s=5.0).__dict__))
    with pytest.raises(RunLocked, match=r"host node-elsewhere, pid 4242, started .* \(last heartbeat 5 s ago\)"):
        RunLock(run_path, heartbeat_s=10.0).acquire()
    assert read_holder(lease).token == "t-foreign"

    # Stale (a lost node): four starts race for it; exactly one takes it, the others find it held.
    lease.write_text(json.dumps(foreign_holder(heartbeat_age_s=31.0).__dict__))
    racers = [hold(run_path, heartbeat_s=10.0, seconds=3.0) for _ in range(1)]
    racers += [subprocess.Popen([sys.executable, "-c", HOLD, str(run_path), "10", "3"], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=repo_on_path()) for _ in range(3)]
    outputs = [racers[0].first_line + racers[0].communicate(timeout=30)[0]]
    outputs += [p.communicate(timeout=30)[0] for p in racers[1:]]
    held = [o for o in outputs if o.startswith("held")]
    assert len(held) == 1, outputs
    assert all(o.startswith("refused") for o in outputs if not o.startswith("held")), outputs
    assert not lease.exists() and not list(run_path.iterdir())


def test_heartbeat_refreshes_the_lease_and_a_taken_lease_is_noticed(tmp_path):
    run_path = tmp_path / "fresh" / "exp"
    lock = RunLock(run_path, heartbeat_s=0.1).acquire()
    first = read_holder(run_path / LOCK_FILE)
    assert first.pid == os.getpid() and first.host == this_host()["host"]
    time.sleep(0.45)
    assert read_holder(run_path / LOCK_FILE).heartbeat > first.heartbeat + 0.2
    # Another start took the lease (this process had stalled past the stale time): the heartbeat leaves it alone.
    (run_path / LOCK_FILE).write_text(json.dumps(foreign_holder(heartbeat_age_s=0.0).__dict__))
    time.sleep(0.3)
    assert lock.lost and read_holder(run_path / LOCK_FILE).token == "t-foreign"
    lock.release()
    assert read_holder(run_path / LOCK_FILE).token == "t-foreign"  # not ours: not removed
    other = tmp_path / "fresh" / "other"  # a start refused after taking the lease leaves no empty directory
    RunLock(other).acquire().release()
    assert not other.exists()
