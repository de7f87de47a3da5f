"""What a run directory records about how the run was started (its `run_start` event): the code's git commit and
whether the checkout had changes, the command line, and the Hydra overrides of this job (one job of a multirun has
its own). Enough to start the same run again from the run directory alone."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any


def git_state(repo: Path) -> dict[str, Any]:
    """{"git_commit": sha or None, "git_dirty": bool or None}; None where repo is not a git checkout (an installed
    copy, a container without git)."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit.strip() if commit else None,
            "git_dirty": bool(status.strip()) if status is not None else None}


def hydra_job() -> dict[str, Any]:
    """This job's overrides, and for a multirun its number in the sweep (empty outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return {}
    if not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    job: dict[str, Any] = {"overrides": list(hc.overrides.task)}
    if hc.mode == RunMode.MULTIRUN:
        job["sweep_job"] = hc.job.num
    return job


def start_record(repo: Path) -> dict[str, Any]:
    """The fields the driver adds to `run_start`."""
    return {**git_state(repo), "command": shlex.join([Path(sys.executable).name, *sys.argv]), **hydra_job()}
