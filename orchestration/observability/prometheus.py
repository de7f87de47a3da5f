"""A local Prometheus that scrapes the Ray cluster's metrics endpoints: `make monitor` / `python -m
orchestration.observability.prometheus`.

Where the targets come from: the Ray dashboard on the head node writes the addresses of every live node's metrics
endpoint to <session dir>/prom_metrics_service_discovery.json (Prometheus file service discovery) and keeps a link
to the newest session's file at <Ray temp dir>/prom_metrics_service_discovery.json (/tmp/ray/ by default,
$RAY_TMPDIR/ray/ when set). Prometheus watches that file, so it can be started before or after the job, and it
follows the next job's cluster without a restart.

Bound to 127.0.0.1 only (port 9090 by default, the address the Ray dashboard's Metrics page looks for when
RAY_PROMETHEUS_HOST is not set); data under <run root>/_prometheus unless --data-dir says otherwise.
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
DEFAULT_PORT = 9090
# Ray's metrics agents export every 10 s by default (metrics_report_interval_ms); scraping every 5 s sees each
# export within half an interval without Prometheus storing many repeats.
DEFAULT_SCRAPE_INTERVAL_S = 5.0


def ray_temp_dir() -> Path:
    """Where a Ray cluster started on this machine without --temp-dir keeps its sessions ($RAY_TMPDIR/ray, /tmp/ray)."""
    return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"


def service_discovery_file(temp_dir: Path | None = None) -> Path:
    """The file-SD file that follows the newest Ray session under `temp_dir` (default `ray_temp_dir()`)."""
    return (temp_dir or ray_temp_dir()) / SERVICE_DISCOVERY_FILE


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
        raise FileNotFoundError("no `prometheus` binary on PATH: install it (Debian/Ubuntu: apt-get install -y "
                                "prometheus, which `make setup` does as root) or download it from prometheus.io")
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


def main(argv: list[str] | None = None) -> int:
    from orchestration.config import REPO_ROOT

    parser = argparse.ArgumentParser(prog="python -m orchestration.observability.prometheus",
                                     description="Run Prometheus on the Ray cluster's metrics until Ctrl-C.")
    parser.add_argument("--ray-temp-dir", type=Path, default=None,
                        help="the Ray temp dir whose newest session to follow (default $RAY_TMPDIR/ray or /tmp/ray)")
    parser.add_argument("--data-dir", type=Path, default=REPO_ROOT / "runs" / "_prometheus")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--scrape-interval-s", type=float, default=DEFAULT_SCRAPE_INTERVAL_S)
    parser.add_argument("--retention", default="15d", help="how long Prometheus keeps samples (its duration syntax)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    sd_file = service_discovery_file(args.ray_temp_dir)
    if not sd_file.exists():
        log.info("%s does not exist yet: Prometheus picks it up when a Ray cluster with a dashboard starts", sd_file)
    try:
        server = Prometheus(sd_file, args.data_dir, port=args.port, scrape_interval_s=args.scrape_interval_s,
                            retention=args.retention)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with server:
        server.wait_ready()
        print(f"Prometheus: {server.url} (targets from {sd_file}; data in {args.data_dir}; log {server.log_path})",
              flush=True)
        print(f"For the Ray dashboard's Metrics page start the cluster with RAY_PROMETHEUS_HOST={server.url}"
              " (the default when the port is 9090). Ctrl-C stops it.", flush=True)
        try:
            server.proc.wait()
        except KeyboardInterrupt:
            pass
    return 0 if server.proc.returncode in (0, -signal.SIGTERM, None) else server.proc.returncode


if __name__ == "__main__":
    sys.exit(main())
