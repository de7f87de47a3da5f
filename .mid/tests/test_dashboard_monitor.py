"""`make monitor` (python -m orchestration.observability.prometheus) follows one run's Ray cluster, read from the
`ray_session` event its driver wrote, never the newest cluster on the machine; RUN= picks the run; SIGTERM and
SIGHUP stop it and its Prometheus as Ctrl-C does. A real Prometheus, run directories written by the product's own
RunDir, Ray's service-discovery file format."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from orchestration.observability.events import RunDir
from orchestration.observability.prometheus import SERVICE_DISCOVERY_FILE, TargetFollower, newest_run
from tests.conftest import REPO, SESSION_MARK, SESSION_MARK_ENV, marked_processes, repo_on_path
from tests.spawned import free_port


def fake_run(run_root: Path, name: str, target: str, at: float) -> Path:
    """A run directory whose driver recorded a Ray session whose dashboard lists one metrics target."""
    session = run_root.parent / f"session_{name}"
    session.mkdir(parents=True)
    (session / SERVICE_DISCOVERY_FILE).write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [target]}]))
    run_dir = RunDir(run_root / name)
    run_dir.event("run_start", 0, run_name=name)
    record = run_dir.event("ray_session", 0, session_dir=str(session), dashboard_url="http://127.0.0.1:8265")
    # the event's time as if written at `at`
    lines = (run_dir.path / "events.jsonl").read_text().replace(json.dumps(record["time"]), json.dumps(at))
    (run_dir.path / "events.jsonl").write_text(lines)
    return run_dir.path


def test_follower_takes_the_named_run_or_the_newest_and_moves_to_the_next(tmp_path):
    root = tmp_path / "runs"
    old = fake_run(root, "old", "127.0.0.1:1001", at=100.0)
    fake_run(root, "new", "127.0.0.1:1002", at=200.0)
    assert newest_run(root) == root / "new"
    out = tmp_path / "targets.json"
    named = TargetFollower(out, run_dir=old)
    assert named.sync() and json.loads(out.read_text())[0]["targets"] == ["127.0.0.1:1001"]
    assert not named.sync()  # unchanged: not rewritten
    newest = TargetFollower(out, run_root=root)
    assert newest.sync() and json.loads(out.read_text())[0]["targets"] == ["127.0.0.1:1002"]
    fake_run(root, "next", "127.0.0.1:1003", at=time.time())  # a new run starts: followed without a restart
    assert newest.sync() and json.loads(out.read_text())[0]["targets"] == ["127.0.0.1:1003"]
    empty = TargetFollower(tmp_path / "none.json", run_root=tmp_path / "nothing")
    assert empty.sync() and json.loads((tmp_path / "none.json").read_text()) == []


def active_targets(url: str) -> set[str]:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=10) as resp:
            data = json.loads(resp.read())["data"]["activeTargets"]
    except OSError:
        return set()
    return {t["labels"]["instance"] for t in data}


def prometheus_processes(data_dir: Path) -> dict[int, str]:
    return {pid: cmd for pid, cmd in marked_processes(SESSION_MARK_ENV, SESSION_MARK).items()
            if f"--storage.tsdb.path={data_dir}" in cmd}


def monitor(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, str, Path, list[str]]:
    port, data_dir = free_port(), tmp_path / f"prom_{name}"
    proc = subprocess.Popen([sys.executable, "-m", "orchestration.observability.prometheus", "--run-root",
                             str(tmp_path / "runs"), "--port", str(port), "--data-dir", str(data_dir),
                             "--scrape-interval-s", "1", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=repo_on_path())
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    return proc, f"http://127.0.0.1:{port}", data_dir, out


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_monitor_scrapes_this_run_and_stops_prometheus_on_sigterm_and_sighup(tmp_path):
    root = tmp_path / "runs"
    fake_run(root, "old", "127.0.0.1:1001", at=100.0)
    fake_run(root, "new", "127.0.0.1:1002", at=200.0)
    for args, expected, sig in (((), "127.0.0.1:1002", signal.SIGTERM), (("--run", "old"), "127.0.0.1:1001",
                                                                          signal.SIGHUP)):
        proc, url, data_dir, out = monitor(tmp_path, sig.name, *args)
        try:
            wait_for(lambda url=url, expected=expected: active_targets(url) == {expected}, 120,
                     f"Prometheus scraping {expected}")
            assert prometheus_processes(data_dir)
            proc.send_signal(sig)
            assert proc.wait(timeout=60) == 0, "".join(out)
            assert not prometheus_processes(data_dir), f"Prometheus left running after {sig.name}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        assert any("following the run" in line for line in out), out


def test_a_run_that_does_not_exist_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "orchestration.observability.prometheus", "--run-root",
                           str(tmp_path), "--run", "nope"], cwd=REPO, capture_output=True, text=True, check=False,
                          env=repo_on_path())
    assert proc.returncode == 2 and "is not a run directory" in proc.stderr, proc.stderr
