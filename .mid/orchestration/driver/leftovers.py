"""Processes of an embedded Ray cluster whose driver died (SIGKILL, OOM killer): ended by the next start of the run.

A driver that started its own cluster records the cluster's processes (its descendants: GCS, raylet, the dashboard
and runtime-env agents, workers) in the run directory, RAY_PROCESSES_FILE, with each pid's start time, and keeps the
record current while the job runs; a normal end removes the file. Left behind, the dashboard and runtime-env agents outlived a SIGKILLed driver by 35 s and more,
holding ports and memory. The next start of the same run (it holds the run's lease, driver/run_lock.py, so the
dead driver is not running) ends those still running: by pid, and only a pid that still runs the program it ran
then (same start time on the same boot: a reused pid is left alone), never by a name pattern.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from orchestration.driver.run_lock import process_start_ticks, read_proc_text, this_host

log = logging.getLogger(__name__)

RAY_PROCESSES_FILE = "ray_processes.json"


def descendants(root_pid: int) -> list[int]:
    """The pids below root_pid (not itself), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_proc_text(f"/proc/{entry}/stat")
            if stat:
                children.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(out)


def record_ray_processes(run_path: Path) -> int:
    """Write the driver's descendants (the embedded cluster it just started) to RAY_PROCESSES_FILE; their count."""
    here = this_host()
    processes = [{"pid": pid, "start": process_start_ticks(pid),
                  "cmd": (read_proc_text(f"/proc/{pid}/cmdline") or "").replace("\0", " ")[:300]}
                 for pid in descendants(os.getpid())]
    record = {"host": here["host"], "boot_id": here["boot_id"], "pid_namespace": here["pid_namespace"],
              "driver_pid": os.getpid(), "processes": [p for p in processes if p["start"] is not None]}
    tmp = run_path / (RAY_PROCESSES_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, run_path / RAY_PROCESSES_FILE)
    return len(record["processes"])


class RayProcessRecord:
    """Keeps RAY_PROCESSES_FILE current while the job runs: the raylet starts its agents and the Train workers after
    ray.init returns, so the record is rewritten every every_s seconds (a /proc scan) until stop() removes it."""

    def __init__(self, run_path: Path, every_s: float = 5.0):
        import threading

        self.run_path = run_path
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ray-process-record", daemon=True)

    def start(self) -> RayProcessRecord:
        record_ray_processes(self.run_path)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                record_ray_processes(self.run_path)
            except OSError as exc:  # a full disk must not end the run; the record only ages
                log.warning("cannot update %s: %s", self.run_path / RAY_PROCESSES_FILE, exc)

    def stop(self) -> None:
        """After the cluster was shut down: nothing is left to end."""
        self._stop.set()
        self._thread.join(timeout=5)
        (self.run_path / RAY_PROCESSES_FILE).unlink(missing_ok=True)


def end_leftovers(run_path: Path, grace_s: float = 3.0) -> list[dict]:
    """End the recorded processes of a dead start that still run (SIGTERM, SIGKILL after grace_s) and remove the
    record. Returns the processes ended. Only on the host, boot and pid namespace that recorded them."""
    path = run_path / RAY_PROCESSES_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        return []
    here = this_host()
    if (record.get("host"), record.get("boot_id"), record.get("pid_namespace")) != \
            (here["host"], here["boot_id"], here["pid_namespace"]):
        log.warning("%s lists Ray processes of host %s: not this machine, left alone", path, record.get("host"))
        path.unlink(missing_ok=True)
        return []
    alive = [p for p in record.get("processes", [])
             if p["pid"] != os.getpid() and process_start_ticks(p["pid"]) == p["start"]]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                os.kill(p["pid"], sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while time.time() < deadline and any(process_start_ticks(p["pid"]) == p["start"] for p in alive):
            time.sleep(0.1)
    if alive:
        log.warning("Ended %d processes of the embedded Ray cluster a dead start of this run left behind (driver "
                    "pid %s): %s", len(alive), record.get("driver_pid"), ", ".join(str(p["pid"]) for p in alive))
    path.unlink(missing_ok=True)
    return alive
