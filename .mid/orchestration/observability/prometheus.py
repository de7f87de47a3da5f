"""A local Prometheus that scrapes one run's Ray cluster: `make monitor` (RUN=<run name or directory> picks the run;
by default the newest under runs/, and the next one when a new run starts) or `python -m
orchestration.observability.prometheus`.

Where the targets come from: the Ray dashboard on the head node writes the addresses of every live node's metrics
endpoint to <session dir>/prom_metrics_service_discovery.json (Prometheus file service discovery). The driver
records its cluster's session directory in the run directory (a `ray_session` event, orchestration/driver/
ray_job.py), so the monitor follows that run's cluster and never another one on the same machine (another user's
job shares /tmp/ray). It copies the run's file into its own data directory whenever it changes, and Prometheus
watches the copy: it can be started before or after the job.

Bound to 127.0.0.1 only (port 9090 by default, the address the Ray dashboard's Metrics page looks for when
RAY_PROMETHEUS_HOST is not set); data under <run root>/_prometheus unless --data-dir says otherwise. Ctrl-C,
SIGTERM and SIGHUP stop it and its Prometheus.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Self

log = logging.getLogger(__name__)

SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"
# The event the driver writes once its Ray cluster is up (orchestration/driver/ray_job.py).
RAY_SESSION_EVENT = "ray_session"
DEFAULT_PORT = 9090
# Ray's metrics agents export every 10 s by default (metrics_report_interval_ms); scraping every 5 s sees each
# export within half an interval without Prometheus storing many repeats.
DEFAULT_SCRAPE_INTERVAL_S = 5.0


def prometheus_config(sd_file: Path, scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S) -> str:
    """prometheus.yml scraping the Ray metrics targets listed in `sd_file` (pure). JSON is valid YAML."""
    if scrape_interval_s <= 0:
        raise ValueError(f"scrape_interval_s={scrape_interval_s} must be > 0 (seconds between scrapes)")
    interval = f"{round(scrape_interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": "ray",
            # The file is rewritten (and the link replaced) when nodes come and go; re-reading it every few seconds
            # also covers a link that appears after Prometheus started.
            "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "5s"}],
        }],
    }
    return json.dumps(config, indent=2) + "\n"


def find_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise FileNotFoundError("no `prometheus` binary on PATH: install it (Debian/Ubuntu: apt-get install "
                                "--no-install-recommends prometheus, which `make monitor` does as root) or download it "
                                "from prometheus.io")
    return path


class Prometheus:
    """One Prometheus server process; `stop()` (or leaving the `with` block) ends it."""

    def __init__(self, sd_file: Path, data_dir: Path, port: int = DEFAULT_PORT, host: str = "127.0.0.1",
                 scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S, retention: str = "15d"):
        self.url = f"http://{host}:{port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = data_dir / "prometheus.yml"
        self.config_path.write_text(prometheus_config(sd_file, scrape_interval_s))
        self.log_path = data_dir / "prometheus.log"
        cmd = [find_binary(), f"--config.file={self.config_path}", f"--storage.tsdb.path={data_dir / 'tsdb'}",
               f"--web.listen-address={host}:{port}", f"--storage.tsdb.retention.time={retention}"]
        with open(self.log_path, "ab") as log_file:
            # Its own process group, so stop() ends it and nothing it started outlives it.
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; its log ({self.log_path}):\n"
                                   + self.log_path.read_text()[-2000:])
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus at {self.url} not ready after {timeout_s:.0f} s (log: {self.log_path})")

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns the "data" field."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read().decode())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} failed: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query: [{"metric": {labels}, "value": [t, "v"]}, ...]."""
        return self.api("query", query=promql)["result"]

    def query_range(self, promql: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """Range query: [{"metric": {labels}, "values": [[t, "v"], ...]}, ...]."""
        return self.api("query_range", query=promql, start=start, end=end, step=step_s)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets")["activeTargets"]

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # Prometheus flushes its head block on SIGTERM
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass


def run_session_dir(run_dir: Path) -> Path | None:
    """The Ray session directory of the run's newest start (None before its cluster is up)."""
    from orchestration.observability.events import EVENTS_FILE, read_jsonl

    sessions = [e for e in read_jsonl(run_dir / EVENTS_FILE) if e.get("event") == RAY_SESSION_EVENT]
    return Path(sessions[-1]["session_dir"]) if sessions and sessions[-1].get("session_dir") else None


def newest_run(run_root: Path) -> Path | None:
    """The run directory under run_root whose cluster started last (None when no run has started one)."""
    from orchestration.observability.events import EVENTS_FILE, read_jsonl

    newest: tuple[float, Path] | None = None
    for events in run_root.glob(f"*/{EVENTS_FILE}"):
        times = [e["time"] for e in read_jsonl(events) if e.get("event") == RAY_SESSION_EVENT]
        if times and (newest is None or max(times) > newest[0]):
            newest = (max(times), events.parent)
    return newest[1] if newest else None


class TargetFollower:
    """Keeps `out_file` (the file Prometheus watches) equal to the service-discovery file of one run's cluster:
    `run_dir` when given, else the newest run under `run_root`, looked up again at every sync."""

    def __init__(self, out_file: Path, run_dir: Path | None = None, run_root: Path | None = None):
        self.out_file, self.run_dir, self.run_root = out_file, run_dir, run_root
        self.following: Path | None = None
        self._written: str | None = None

    def source(self) -> Path | None:
        run = self.run_dir or (newest_run(self.run_root) if self.run_root else None)
        self.following = run
        session = run_session_dir(run) if run else None
        return session / SERVICE_DISCOVERY_FILE if session else None

    def sync(self) -> bool:
        """Copy the run's targets (none while it has no cluster) when they changed; returns whether it wrote."""
        src = self.source()
        try:
            text = src.read_text() if src else "[]"
            json.loads(text)  # the dashboard replaces it whole; a half-written file waits for the next sync
        except (OSError, ValueError):
            text = "[]" if self._written is None else self._written
        if text == self._written:
            return False
        tmp = self.out_file.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.out_file)
        self._written = text
        return True


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP (a closed terminal, a supervisor's stop) end the monitor as Ctrl-C does, through the
    `with` block that stops Prometheus."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)


def resolve_run(run: str, run_root: Path) -> Path:
    """RUN= as given: a run directory, or a run name under run_root."""
    path = Path(run)
    return path if path.is_dir() or path.is_absolute() or os.sep in run else run_root / run


def main(argv: list[str] | None = None) -> int:
    from orchestration.config import REPO_ROOT

    parser = argparse.ArgumentParser(prog="python -m orchestration.observability.prometheus",
                                     description="Run Prometheus on one run's Ray cluster metrics until stopped.")
    parser.add_argument("--run", default=None,
                        help="the run to follow: its directory or its name under --run-root (default: the newest "
                             "run there, and the next one that starts)")
    parser.add_argument("--run-root", type=Path, default=REPO_ROOT / "runs")
    parser.add_argument("--data-dir", type=Path, default=None, help="default: <run root>/_prometheus")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--scrape-interval-s", type=float, default=DEFAULT_SCRAPE_INTERVAL_S)
    parser.add_argument("--retention", default="15d", help="how long Prometheus keeps samples (its duration syntax)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stop_on_signals()

    data_dir = args.data_dir or args.run_root / "_prometheus"
    data_dir.mkdir(parents=True, exist_ok=True)
    run_dir = resolve_run(args.run, args.run_root) if args.run else None
    if run_dir is not None and not (run_dir / "events.jsonl").exists():
        print(f"error: {run_dir} is not a run directory (no events.jsonl): RUN= takes a run name under "
              f"{args.run_root} or a run directory", file=sys.stderr)
        return 2
    follower = TargetFollower(data_dir / "targets.json", run_dir=run_dir, run_root=args.run_root)
    follower.sync()
    try:
        server = Prometheus(follower.out_file, data_dir, port=args.port, scrape_interval_s=args.scrape_interval_s,
                            retention=args.retention)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with server:
            server.wait_ready()
            which = run_dir or f"the newest run under {args.run_root}"
            print(f"Prometheus: {server.url} scraping the Ray cluster of {which} (data in {data_dir}; log "
                  f"{server.log_path})", flush=True)
            print(f"For the Ray dashboard's Metrics page start the cluster with RAY_PROMETHEUS_HOST={server.url}"
                  " (the default when the port is 9090). Ctrl-C stops it.", flush=True)
            following = None
            while server.proc.poll() is None:
                follower.sync()
                if follower.following != following:
                    following = follower.following
                    print(f"following the run {following}" if following else "no run has started a cluster yet",
                          flush=True)
                time.sleep(2)
    except KeyboardInterrupt:
        pass
    return 0 if server.proc.returncode in (0, -signal.SIGTERM, None) else server.proc.returncode


if __name__ == "__main__":
    sys.exit(main())
