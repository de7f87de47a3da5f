"""What a person watching a real job sees: the Ray dashboard's Train state (runs, attempts, workers) through its HTTP
API, the run on the dashboard's Jobs page in headless Chromium, and the job's elastic_fp8 metrics in a real
Prometheus scraping the targets Ray lists for its session.

Each test runs launch.py on its own embedded cluster (2 CPU workers) under its own RAY_TMPDIR, so the Prometheus
started here follows that session's service-discovery file and no other cluster's. The cluster runs with the
product's default, token authentication on: the tests use the commands the driver prints (the token from
`ray get-auth-token`, the curl line) as written, and the browser types the token into the dashboard's own prompt.

Every wait is for the condition it needs, with a deadline, polled: on a loaded 2-core machine a dashboard request
can take longer than any fixed HTTP timeout, so a request that times out is one more try, not a failure.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from orchestration.observability import dashboard as dash
from orchestration.observability.events import read_jsonl
from orchestration.observability.prometheus import Prometheus, TargetFollower, run_session_dir
from tests.conftest import REPO
from tests.spawned import free_port

pytestmark = pytest.mark.slow

STEPS = 60
BATCH = 8
COMMON = ["model=debug_dense", f"train.steps={STEPS}", f"train.global_batch_size={BATCH}", "data.seq_len=64",
          "train.log_every=1", "checkpoint.every_steps=10", "monitor.good_after_steps=5", "logging.wandb=false",
          "logging.progress_every_s=5"]
DASHBOARD_LINE = re.compile(r"Ray dashboard: (http://\S+)")
TOKEN_COMMAND = re.compile(r"`([^`]* get-auth-token)` prints it")
CURL_LINE = re.compile(r"Train state: (curl .*)")


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

    def dashboard_url(self, timeout_s: float = 240) -> str:
        return wait_for(lambda: (DASHBOARD_LINE.search(self.log()) or [None, None])[1], timeout_s,
                        "the driver's dashboard line", self)

    def printed(self, pattern: re.Pattern) -> str:
        found = pattern.search(self.log())
        assert found, f"the driver did not print {pattern.pattern!r}:\n{self.log()[-3000:]}"
        return found[1]

    def run_printed(self, command: str, env: dict) -> str:
        """A command the driver printed, run by a shell as a user pastes it."""
        proc = subprocess.run(["bash", "-c", command], check=False, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
        return proc.stdout

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
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                       + (f"; the job's output:\n{job.log()[-3000:]}" if job is not None else ""))


def train_run(url: str, name: str, token: str) -> dict | None:
    """The run as the dashboard lists it; None while it cannot say yet (the state actor appears with the run's
    controller) or does not answer in time (the next poll asks again)."""
    try:
        return dash.find_run(dash.train_runs(url, token=token, timeout_s=30), name)
    except (dash.DashboardError, OSError):
        return None


@pytest.fixture
def job_env(isolated_env):
    # The product's default (token authentication on): isolated_env turns it off for the tests that join nodes.
    env = {k: v for k, v in isolated_env.items() if k != "RAY_AUTH_MODE"}
    # Export every second (Ray's default is 10 s) so a 60-step run leaves many samples in Prometheus.
    env["RAY_metrics_report_interval_ms"] = "1000"
    return env


def token_of(job: Job, env: dict) -> str:
    """The token, read with the command the driver printed; the dashboard refuses a request without it."""
    url = job.dashboard_url()
    token = job.run_printed(job.printed(TOKEN_COMMAND), env).strip()
    assert re.fullmatch(r"\S{16,}", token), token
    try:
        urllib.request.urlopen(url + dash.TRAIN_RUNS_PATH, timeout=60)
        raise AssertionError("the dashboard answered without a token: authentication is off")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401, exc.code
    return token


class BrowserError(RuntimeError):
    """The browser answered a DevTools call with an error."""


class BrowserGone(RuntimeError):
    """The browser's DevTools connection closed (Chromium crashed or exited): not retried."""


class Browser:
    """Headless Chromium driven through the DevTools protocol (its WebSocket, with aiohttp, which ray[default]
    installs): load a page, read its text, type, click, take a screenshot, as a person would."""

    def __init__(self, user_dir: Path):
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        assert binary, "chromium is not installed: `make test` installs it (apt-get install chromium)"
        # --no-sandbox: Chromium refuses to run as root with its sandbox (CI runs as root).
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={user_dir}", "--window-size=1400,900", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        devtools = wait_for(lambda: next((re.search(r"ws://127\.0\.0\.1:(\d+)/", line) for line in self.stderr
                                          if "DevTools listening" in line), None), 120, "Chromium's DevTools port")
        port = devtools[1]
        pages = wait_for(lambda: [t for t in json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{port}/json/list", timeout=30).read()) if t["type"] == "page"], 60, "a page")
        self.loop = asyncio.new_event_loop()
        self.ws, self.session, self.next_id = None, None, 0
        self.loop.run_until_complete(self._connect(pages[0]["webSocketDebuggerUrl"]))

    async def _connect(self, ws_url: str) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession()
        self.ws = await self.session.ws_connect(ws_url, max_msg_size=0)

    async def _call(self, method: str, params: dict) -> dict:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            try:
                msg = await self.ws.receive_json(timeout=120)
            except TypeError as exc:  # a close frame, not text (aiohttp's WSMessageTypeError): say how it ended
                raise BrowserGone(f"{method}: the DevTools connection closed ({exc}); Chromium exit code "
                                   f"{self.proc.poll()}, its last output: {''.join(self.stderr[-20:])}") from exc
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error']}")
                return msg["result"]

    def call(self, method: str, **params) -> dict:
        return self.loop.run_until_complete(self._call(method, params))

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def text(self) -> str:
        """The page's visible text; empty while it is being replaced (a reload)."""
        try:
            return self.evaluate("document.body ? document.body.innerText : ''") or ""
        except BrowserError:
            return ""

    def close(self) -> None:
        async def disconnect():
            await self.ws.close()
            await self.session.close()

        try:
            self.loop.run_until_complete(disconnect())
        finally:
            self.loop.close()
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def series_values(prom: Prometheus, metric: str, run: str, start: float, end: float) -> list[float]:
    """Every sample of `metric` for `run` between start and end, over all its series (one per worker process)."""
    result = prom.query_range(f'{metric}{{run="{run}"}}', start, end, step_s=1)
    return [float(v) for series in result for _, v in series["values"]]


def test_fault_run_in_train_view_jobs_page_and_prometheus(tmp_path, job_env, no_ray_leftovers):
    """A loss-spike run (skip, FP8 -> BF16 fallback, rollback) with token authentication on: the driver's curl line
    works as printed, the Train view lists the run with its 2 workers while it runs, a browser that types the token
    into the dashboard's prompt sees the run on the Jobs page, the console shows the skip, the fallback and the
    rollback as they happen, and Prometheus holds its loss, eval loss, throughput, world size, precision, counters,
    checkpoint stall and FP8 saturation/underflow with the values the run wrote to metrics.jsonl and events.jsonl."""
    name = "dash-spike"
    # What `make monitor RUN=dash-spike` does: the targets of the session the driver records in the run directory.
    follower = TargetFollower(tmp_path / "targets.json", run_dir=tmp_path / name)
    follower.sync()
    following = threading.Event()

    def follow() -> None:
        while not following.wait(1):
            follower.sync()

    threading.Thread(target=follow, daemon=True).start()
    with Prometheus(follower.out_file, tmp_path / "prometheus", port=free_port(), scrape_interval_s=1) as prom:
        prom.wait_ready()
        t_start = time.time()
        job = Job(tmp_path, job_env, name, "precision=fp8", "faults=loss_spike", "faults.rank=0", "faults.step=30",
                  "faults.num_steps=3", "train.eval_every=20")
        try:
            url = job.dashboard_url()
            token = token_of(job, job_env)

            def running():
                run = train_run(url, name, token)
                live = run and run["status"] == "RUNNING" and [a for a in dash.attempts(run) if a.status == "RUNNING"]
                return (run, live[0]) if live else None

            run, attempt = wait_for(running, 300, "the run RUNNING in the Train view", job)
            assert attempt.world_size == 2 and len(set(attempt.worker_pids)) == 2
            assert run["run_settings"]["scaling_config"]["num_workers"] == 2
            # The driver's curl line, as printed (its URL is this cluster's dashboard).
            listed = json.loads(job.run_printed(job.printed(CURL_LINE), job_env))
            assert dash.find_run(listed["train_runs"], name) is not None

            with Browser(tmp_path / "chromium") as browser:
                browser.call("Page.navigate", url=f"{url}/#/jobs")
                wait_for(lambda: "Authentication Token Required" in browser.text(), 180,
                         "the dashboard asking for its token", job)
                # Typed into the prompt's token field, then its Submit button, which reloads the page.
                browser.evaluate("document.querySelector('[role=dialog] input[type=password]').focus()")
                browser.call("Input.insertText", text=token)
                browser.evaluate("const submit = [...document.querySelectorAll('[role=dialog] button')].find("
                                 "b => b.innerText.trim().toUpperCase() === 'SUBMIT'); setTimeout(() => submit.click())")
                text = wait_for(lambda: (t := browser.text()) and name in t and t, 180,
                                "the run's name on the dashboard's Jobs page", job)
                assert "Authentication Token Required" not in text
                shot = tmp_path / "jobs_page.png"
                shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot")["data"]))
                assert shot.stat().st_size > 10_000  # a rendered page, not an empty canvas (~50 KB)
                # The Train state as the authenticated browser gets it (the open-source dashboard has no page of its
                # own for it): its cookie now carries the token.
                browser.call("Page.navigate", url=url + dash.TRAIN_RUNS_PATH)
                wait_for(lambda: re.search(rf'"name": ?"{name}"', browser.text()), 120, "the Train state in the browser")

            scraped = wait_for(lambda: [t for t in prom.targets() if t["health"] == "up"], 120,
                               "Prometheus scraping Ray's targets", job)
            assert len(scraped) >= 2  # the node's metrics agent and the dashboard at least
            job.finish()
        finally:
            job.kill()
        t_end = time.time()
        following.set()
        # The session the driver recorded is this job's own, under the test's RAY_TMPDIR.
        assert run_session_dir(job.run_dir).parent == Path(job_env["RAY_TMPDIR"]) / "ray"

        metrics = read_jsonl(job.run_dir / "metrics.jsonl")
        events = read_jsonl(job.run_dir / "events.jsonl")
        summary = json.loads((job.run_dir / "summary.json").read_text())
        assert summary["fallbacks"] == 1 and summary["rollbacks"] == 1 and summary["skipped_steps"] >= 1

        # The console told each decision once, as it happened, in the order the run took them.
        rank0 = [e for e in events if e.get("worker_rank", 0) == 0]
        skip = next(e for e in rank0 if e["event"] == "step_skipped")
        fallback = next(e for e in rank0 if e["event"] == "precision_changed" and e["to"] == "bf16")
        rollback = next(e for e in rank0 if e["event"] == "rollback")
        decided = {e["step"]: e for e in rank0 if e["event"] == "policy_decision"}
        log = job.log()
        expected = [f"[event] step {skip['step']}: update skipped (loss_spike ",
                    (f"[event] step {fallback['step']}: FP8 -> BF16 for the whole model until step "
                     f"{decided[fallback['step']]['until_step']}, update dropped (loss_spike "),
                    f"[event] step {rollback['from_step']}: rolled back to step {rollback['to_step']} (loss_spike ",
                    f"; {rollback['skipped_samples']} samples skipped [{rollback['skipped_range'][0]}, "]
        at = [log.find(text) for text in expected]
        assert all(i >= 0 for i in at) and at == sorted(at), (expected, at, log[-4000:])
        assert log.count("update skipped") == 1 and log.count("FP8 -> BF16") == 1  # worker 1's copies not printed
        assert "[event] step 20: eval loss " in log
        progress = re.findall(r"\[progress\] step +(\d+)/60  loss \S+  ([\d.]+) s/step  ETA (\S+ ?s?)", log)
        assert progress and progress[0][0] == "1", log[-4000:]  # the first line when the first step ended
        assert all(float(sps) > 0 for _, sps, _ in progress) and progress[-1][0] == "60"

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
    worker processes, read from the dashboard while the run goes on; the console says the worker was lost and
    from which step the run restarted."""
    name = "dash-crash"
    job = Job(tmp_path, job_env, name, "precision=bf16", "faults=crash", "faults.rank=1", "faults.step=20")
    try:
        url = job.dashboard_url()
        token = token_of(job, job_env)

        def restarted():
            run = train_run(url, name, token)
            tries = dash.attempts(run) if run else []
            going = run and run["status"] in ("RUNNING", "FINISHED")
            return tries if going and len(tries) == 2 and tries[1].status in ("RUNNING", "FINISHED") else None

        first, second = wait_for(restarted, 400, "the run going on in a second attempt", job)
        assert first.status == "ERRORED" and first.world_size == 2 and second.world_size == 2
        assert not set(first.worker_pids) & set(second.worker_pids)  # new worker processes
        job.finish()
    finally:
        job.kill()
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == 1
    log = job.log()
    assert "[event] step 20: a worker was lost: restarted with 2 workers (was 2)" in log, log[-3000:]
    assert re.search(r"\[event\] step 20: restarted from checkpoint step 20 on 2 workers, [\d.]+ s after", log), \
        log[-3000:]
