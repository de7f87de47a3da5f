"""What makes a run visible in the Ray dashboard: Ray Train's state tracking, the job's name, and the settings
that point the dashboard at Prometheus and Grafana.

Ray Train (V2, Ray's default in 2.60) records runs, attempts and workers for the dashboard only when
RAY_TRAIN_ENABLE_STATE_TRACKING=1 is in the environment of the process that builds the trainer: the driver.
The trainer reads it there and hands the controller a callback that creates the state actor (detached, so the
dashboard can ask it), whether the cluster is embedded or joined by address; nothing has to be set on the nodes.
The dashboard serves that state at `TRAIN_RUNS_PATH`. Its older path /api/train/v2/runs answers for Train V1 runs
only and keeps saying "Train state data is not available" for V2 runs with tracking on.

Ray 2.60's open-source dashboard has no Train page of its own (its pages are Overview, Jobs, Serve, Cluster, Actors,
Metrics, Logs); a person finds the run on the Jobs page, whose Name column shows the job's metadata "job_name":
`job_metadata` sets it to the run name.

The dashboard reads RAY_PROMETHEUS_HOST, RAY_GRAFANA_HOST and the rest of `MONITORING_ENV_KEYS` from its own
environment when it starts: for an embedded cluster that is the driver's environment, for a joined cluster the
head node's (`ray start --head` or the KubeRay head container).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

STATE_TRACKING_ENV = "RAY_TRAIN_ENABLE_STATE_TRACKING"
TRAIN_RUNS_PATH = "/api/train/v2/runs/v1"
MONITORING_ENV_KEYS = ("RAY_PROMETHEUS_HOST", "RAY_PROMETHEUS_NAME", "RAY_PROMETHEUS_HEADERS", "RAY_GRAFANA_HOST",
                       "RAY_GRAFANA_IFRAME_HOST", "RAY_GRAFANA_ORG_ID")


def state_tracking_env() -> dict[str, str]:
    """The driver environment that makes the Train view list runs, their attempts and workers."""
    return {STATE_TRACKING_ENV: "1"}


def job_metadata(run_name: str) -> dict[str, str]:
    """Ray job metadata: "job_name" is what the dashboard's Jobs page shows in its Name column."""
    return {"job_name": run_name}


class DashboardError(RuntimeError):
    """The dashboard answered, but not with Train state (tracking off, or no run started yet)."""


@dataclass(frozen=True)
class Attempt:
    """One worker group of a run: each (re)start, elastic resize included, is a new attempt."""

    attempt_id: str
    status: str
    world_size: int
    worker_pids: tuple[int, ...]


def train_runs(dashboard_url: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The Train runs the dashboard knows (newest first), as its HTTP API returns them."""
    url = dashboard_url.rstrip("/") + TRAIN_RUNS_PATH
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode())["train_runs"]
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:500]
        raise DashboardError(f"{url} answered {exc.code}: {body} (is {STATE_TRACKING_ENV}=1 in the driver's "
                             "environment, and has the run started?)") from None


def attempts(run: dict[str, Any]) -> list[Attempt]:
    """A run's attempts in start order (pure)."""
    ordered = sorted(run.get("attempts", []), key=lambda a: a["start_time_ns"])
    return [Attempt(a["attempt_id"], str(a["status"]), len(a.get("workers", [])),
                    tuple(w["pid"] for w in a.get("workers", []))) for a in ordered]


def find_run(runs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The newest run called `name`, or None."""
    named = [r for r in runs if r.get("name") == name]
    return max(named, key=lambda r: r["start_time_ns"]) if named else None
