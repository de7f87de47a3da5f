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

Token authentication (on by default for the embedded cluster, orchestration/driver/ray_job.py): every dashboard
request carries "Authorization: Bearer <token>"; a browser asks for the token once and keeps it in a cookie. The
token is RAY_AUTH_TOKEN when set, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token, which Ray
writes at the first start; `ray get-auth-token` prints it. `watch_lines` tells the user all this at start.

The dashboard reads RAY_PROMETHEUS_HOST, RAY_GRAFANA_HOST and the rest of `MONITORING_ENV_KEYS` from its own
environment when it starts: for an embedded cluster that is the driver's environment, for a joined cluster the
head node's (`ray start --head` or the KubeRay head container).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
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


def auth_token_file() -> Path:
    """Where Ray keeps the token when RAY_AUTH_TOKEN does not give it."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def read_auth_token() -> str | None:
    """The token Ray's clients on this machine send, as Ray looks it up; None when there is none yet."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    try:
        return auth_token_file().read_text().strip() or None
    except OSError:
        return None


def ray_executable() -> str:
    """The `ray` program of this Python environment: beside the interpreter (a virtual environment's bin/), else the
    one on PATH (Ray installed with pip --target or --user puts its scripts elsewhere); "ray" when there is none."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else shutil.which("ray") or "ray"


def ray_cli() -> str:
    """The `ray` command of this Python environment, as a user types it from the current directory (pure but for
    the lookup): .venv/bin/ray when the project's environment is not activated."""
    exe, beside = ray_executable(), Path(sys.executable).parent / "ray"
    if exe != str(beside):
        return exe
    if shutil.which("ray") == str(beside):
        return "ray"
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)


def token_location() -> str:
    """Where the token of this machine's Ray clients is, in words for the console."""
    return "$RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else str(auth_token_file())


def watch_lines(dashboard_url: str, token_auth: bool, ray_command: str, token_where: str) -> list[str]:
    """What the driver prints about the dashboard at start: its address and, with token authentication, where the
    token is, the command that prints it, and a request that works as written (pure)."""
    api = dashboard_url.rstrip("/") + TRAIN_RUNS_PATH
    if not token_auth:
        return [f"Ray dashboard: {dashboard_url}", f"  Train state: curl -s {api}"]
    token_cmd = f"{shlex.quote(ray_command)} get-auth-token"
    return [f"Ray dashboard: {dashboard_url}",
            (f"  token authentication is on: the browser asks once for the token in {token_where}; "
             f"`{token_cmd}` prints it"),
            f"  Train state: curl -s -H \"Authorization: Bearer $({token_cmd})\" {api}"]


def train_runs(dashboard_url: str, token: str | None = None, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The Train runs the dashboard knows (newest first), as its HTTP API returns them; `token` for a cluster with
    token authentication."""
    url = dashboard_url.rstrip("/") + TRAIN_RUNS_PATH
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
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
