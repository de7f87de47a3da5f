"""What a person watching a real job sees: the Ray dashboard's Train state (runs, attempts, workers) through its HTTP
API, the run on the dashboard's Jobs page in headless Chromium, and the job's elastic_fp8 metrics in a real
Prometheus scraping the targets Ray lists for its session.

Each test runs launch.py on its own embedded cluster (2 CPU workers) under its own RAY_TMPDIR, so the Prometheus
started here follows that session's service-discovery file and no other cluster's.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestration.observability import dashboard as dash
from orchestration.observability.events import read_jsonl
from orchestration.observability.prometheus import Prometheus, service_discovery_file
from tests.conftest import REPO
from tests.spawned import free_port

pytestmark = pytest.mark.slow

STEPS = 60
BATCH = 8
COMMON = ["model=debug_dense", f"train.steps={STEPS}", f"train.global_batch_size={BATCH}", "data.seq_len=64",
          "train.log_every=1", "checkpoint.every_steps=10", "monitor.good_after_steps=5", "logging.wandb=false",
          "logging.progress_every_s=5"]
DASHBOARD_LINE = re.compile(r"Ray dashboard: (http://\S+)")


class Job:
    """launch.py in the background; its stdout in a file, its dashboard URL parsed from the driver's line."""

    def __init__(self, tmp: Path, env: dict, run_name: str, *overrides: str):
        self.run_name = run_name
        self.run_dir = tmp / run_name
        self.log_path = tmp / f"{run_name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), *COMMON, f"run_root={tmp}",
                                          f"run_name={run_name}", *overrides], cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def dashboard_url(self, timeout_s: float = 180) -> str:
        return wait_for(lambda: (DASHBOARD_LINE.search(self.log()) or [None, None])[1], timeout_s,
                        "the driver's dashboard line", self)

    def finish(self, timeout_s: float = 600) -> None:
        assert self.proc.wait(timeout=timeout_s) == 0, self.log()[-4000:]

    def kill(self) -> None:
        """Ctrl-C first: the driver stops its workers and its embedded cluster (tests/test_e2e_train.py checks it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def wait_for(predicate, timeout_s: float, what: str, job: Job | None = None, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(f"the job exited ({job.proc.returncode}) before {what}:\n{job.log()[-4000:]}")
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def train_run(url: str, name: str) -> dict | None:
    try:
        return dash.find_run(dash.train_runs(url), name)
    except dash.DashboardError:
        return None  # the state actor appears with the run's controller


@pytest.fixture
def ray_tmpdir():
    """A short RAY_TMPDIR: Ray's unix sockets live under it and must stay under 107 characters."""
    path = tempfile.mkdtemp(prefix="dsh_", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job_env(isolated_env, ray_tmpdir):
    env = dict(isolated_env)
    # Export every second (Ray's default is 10 s) so a 60-step run leaves many samples in Prometheus.
    env.update({"RAY_TMPDIR": ray_tmpdir, "RAY_metrics_report_interval_ms": "1000"})
    return env


def chromium(url: str, user_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on one page. --virtual-time-budget lets the dashboard's scripts fetch and render first."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "chromium is not installed: `make setup` installs it (apt-get install -y chromium)"
    # --no-sandbox: Chromium refuses to run as root with its sandbox (CI runs as root).
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={user_dir}", "--window-size=1400,900", "--virtual-time-budget=15000", *args, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def series_values(prom: Prometheus, metric: str, run: str, start: float, end: float) -> list[float]:
    """Every sample of `metric` for `run` between start and end, over all its series (one per worker process)."""
    result = prom.query_range(f'{metric}{{run="{run}"}}', start, end, step_s=1)
    return [float(v) for series in result for _, v in series["values"]]


def test_fault_run_in_train_view_jobs_page_and_prometheus(tmp_path, job_env, ray_tmpdir, no_ray_leftovers):
    """A loss-spike run (skip, FP8 -> BF16 fallback, rollback): the Train view lists it with its 2 workers while it
    runs, the Jobs page shows its name, and Prometheus holds its loss, eval loss, throughput, world size, precision,
    counters, checkpoint stall and FP8 saturation/underflow with the values the run wrote to metrics.jsonl and
    events.jsonl."""
    name = "dash-spike"
    sd_file = service_discovery_file(Path(ray_tmpdir) / "ray")
    with Prometheus(sd_file, tmp_path / "prometheus", port=free_port(), scrape_interval_s=1) as prom:
        prom.wait_ready()
        t_start = time.time()
        job = Job(tmp_path, job_env, name, "precision=fp8", "faults=loss_spike", "faults.rank=0", "faults.step=30",
                  "faults.num_steps=3", "train.eval_every=20")
        try:
            url = job.dashboard_url()

            def running():
                run = train_run(url, name)
                live = run and run["status"] == "RUNNING" and [a for a in dash.attempts(run) if a.status == "RUNNING"]
                return (run, live[0]) if live else None

            run, attempt = wait_for(running, 240, "the run RUNNING in the Train view", job)
            assert attempt.world_size == 2 and len(set(attempt.worker_pids)) == 2
            assert run["run_settings"]["scaling_config"]["num_workers"] == 2

            dom = chromium(f"{url}/#/jobs", tmp_path / "chromium", "--dump-dom")
            assert dom.returncode == 0, dom.stderr[-2000:]
            assert f">{name}<" in dom.stdout, "the run's name is not on the dashboard's Jobs page"
            shot = tmp_path / "jobs_page.png"
            chromium(f"{url}/#/jobs", tmp_path / "chromium", f"--screenshot={shot}")
            assert shot.stat().st_size > 10_000  # a rendered page, not an empty canvas (~50 KB)
            # The Train state as a browser gets it (the open-source dashboard has no page of its own for it)
            api = chromium(url + dash.TRAIN_RUNS_PATH, tmp_path / "chromium", "--dump-dom")
            assert re.search(rf'"name": ?"{name}"', api.stdout), api.stdout[:2000]

            scraped = wait_for(lambda: [t for t in prom.targets() if t["health"] == "up"], 60,
                               "Prometheus scraping Ray's targets", job)
            assert len(scraped) >= 2  # the node's metrics agent and the dashboard at least
            job.finish()
        finally:
            job.kill()
        t_end = time.time()

        metrics = read_jsonl(job.run_dir / "metrics.jsonl")
        events = read_jsonl(job.run_dir / "events.jsonl")
        summary = json.loads((job.run_dir / "summary.json").read_text())
        assert summary["fallbacks"] == 1 and summary["rollbacks"] == 1 and summary["skipped_steps"] >= 1

        def values(metric: str) -> list[float]:
            got = series_values(prom, f"ray_elastic_fp8_{metric}", name, t_start, t_end)
            assert got, f"no ray_elastic_fp8_{metric} samples for run {name} in Prometheus"
            return got

        def each_in(samples: list[float], reference: list[float], metric: str) -> None:
            for v in samples:
                assert any(math.isclose(v, r, rel_tol=1e-9) for r in reference), (metric, v, reference[:10])

        each_in(values("loss"), [m["loss"] for m in metrics], "loss")
        each_in(values("eval_loss"), [m["eval_loss"] for m in metrics if m.get("eval_loss") is not None], "eval_loss")
        each_in(values("tokens_per_s"), [m["tokens_per_s"] for m in metrics], "tokens_per_s")
        assert set(values("world_size")) == {2.0}
        # FP8 until the fallback at step 31, BF16 after it: both states were scraped.
        assert set(values("precision_fp8")) == {0.0, 1.0}
        rank0 = [e for e in events if e.get("worker_rank", 0) == 0]
        expected_counts = {"fallbacks_total": 1, "rollbacks_total": 1,
                           "steps_skipped_total": sum(e["event"] == "step_skipped" for e in rank0)}
        for counter, n in expected_counts.items():
            assert max(values(counter)) == n, counter
        stalls = [e["seconds"] for e in events if e["event"] == "checkpoint_timing" and e.get("seconds") is not None]
        each_in(values("checkpoint_stall_s"), stalls, "checkpoint_stall_s")
        for frac in ("fp8_saturated_frac", "fp8_underflow_frac"):
            got = values(frac)
            # fractions; exactly 0 once the run is in BF16 (no value goes through an FP8 cast)
            assert all(0.0 <= v <= 1.0 for v in got) and 0.0 in got, (frac, got[:20])


def test_crash_restart_is_a_second_attempt_in_train_view(tmp_path, job_env, no_ray_leftovers):
    """faults=crash on rank 1: the Train view shows the run's first attempt ERRORED and a second one with 2 new
    worker processes, read from the dashboard while the run goes on."""
    name = "dash-crash"
    job = Job(tmp_path, job_env, name, "precision=bf16", "faults=crash", "faults.rank=1", "faults.step=20")
    try:
        url = job.dashboard_url()

        def restarted():
            run = train_run(url, name)
            tries = dash.attempts(run) if run else []
            going = run and run["status"] in ("RUNNING", "FINISHED")
            return tries if going and len(tries) == 2 and tries[1].status in ("RUNNING", "FINISHED") else None

        first, second = wait_for(restarted, 300, "the run going on in a second attempt", job)
        assert first.status == "ERRORED" and first.world_size == 2 and second.world_size == 2
        assert not set(first.worker_pids) & set(second.worker_pids)  # new worker processes
        job.finish()
    finally:
        job.kill()
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == 1
