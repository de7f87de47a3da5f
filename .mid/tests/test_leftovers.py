"""The suite's own cleanup (tests/conftest.py): a test's processes are found by the mark in their environment and
stopped, whatever their names, and a process without the mark is left alone (another user's Ray cluster)."""

import os
import shlex
import subprocess
import sys
import uuid

from tests.conftest import TEST_MARK_ENV, marked_processes, ray_services, stop_marked

SLEEP = [sys.executable, "-c", ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('ready', flush=True); time.sleep(600)")]


def start(*prefix: str, mark: str) -> subprocess.Popen:
    proc = subprocess.Popen([*prefix, *SLEEP], env={**os.environ, TEST_MARK_ENV: mark}, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
    return proc


def test_marked_processes_are_stopped_and_unmarked_ones_left_alone():
    mark = uuid.uuid4().hex
    marked = start(mark=mark)  # ignores SIGTERM: needs the SIGKILL
    # in its own session, as `ray start --block` and Ray's raylet run
    detached = start("setsid", mark=mark)
    other = start(mark="someone-else")
    try:
        found = marked_processes(TEST_MARK_ENV, mark)
        assert marked.pid in found and other.pid not in found and len(found) == 2, found
        stopped = stop_marked(TEST_MARK_ENV, mark, grace_s=1.0)
        assert set(stopped) == set(found)
        assert marked.wait(timeout=10) == -9
        assert marked_processes(TEST_MARK_ENV, mark) == {}
        assert other.poll() is None
    finally:
        for proc in (marked, detached, other):
            proc.kill()
            proc.wait(timeout=10)


def test_the_session_backstop_spares_this_process_children_and_stops_orphans():
    """An orphan (its launcher died: reparented away from this process) is stopped; a child this process still owns
    (W&B's service, an in-process cluster) is left to its owner."""
    mark = uuid.uuid4().hex
    child = start(mark=mark)
    launcher = subprocess.Popen(["bash", "-c", f"{shlex.join(SLEEP)} >/dev/null & echo $!"], env={**os.environ,
                                TEST_MARK_ENV: mark}, stdout=subprocess.PIPE, text=True)
    orphan = int(launcher.stdout.readline())
    launcher.wait(timeout=30)  # the launcher is gone: its child is nobody's here
    try:
        stopped = stop_marked(TEST_MARK_ENV, mark, grace_s=1.0, spare_children_of=os.getpid())
        assert orphan in stopped and child.pid not in stopped, stopped
        assert child.poll() is None
        assert orphan not in marked_processes(TEST_MARK_ENV, mark)
    finally:
        child.kill()
        child.wait(timeout=10)


def test_ray_services_are_told_by_their_executable():
    processes = {1: "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x",
                 2: "/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --gcs_server_port=1",
                 3: "python launch.py run_name=raylet", 4: "ray::TrainController"}
    assert ray_services(processes) == {1: processes[1], 2: processes[2]}
