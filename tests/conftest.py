import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background by a non-interactive shell inherits SIGINT ignored (POSIX), and every launcher
# it starts would too: the tests that press Ctrl-C on a run (send SIGINT) then saw it train on for 120 s. A handler
# is reset to the default at exec, an ignored signal is not: give this process the handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def isolated_env(tmp_path):
    """Environment for launching jobs: W&B, Ray and caches inside tmp_path, no auth tokens."""
    env = dict(os.environ)
    env.update({
        "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"), "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
    })
    return env


def launch(env: dict, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run launch.py in a subprocess (its own Ray cluster, cleaned up by launch.py itself)."""
    proc = subprocess.run([sys.executable, str(REPO / "launch.py"), *overrides], check=False, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)
    return proc


def ray_processes_left() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "raylet|gcs_server"], check=False, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture(autouse=False)
def no_ray_leftovers():
    yield
    leftovers = ray_processes_left()
    if leftovers:
        subprocess.run([which_ray(), "stop", "--force"], check=False, capture_output=True)
    assert not leftovers, f"Ray processes left behind: {leftovers}"


def which_ray() -> str:
    return shutil.which("ray") or str(Path(sys.executable).parent / "ray")


@pytest.fixture(autouse=True)
def restore_grouped_body_mode(monkeypatch):
    """The grouped GEMM body mode is process-wide (fp8.grouped.set_body_mode, set by compile_blocks for CUDA graphs):
    restore it and compile_blocks' record of it after every test, so no test sees another's setting."""
    import fp8.grouped

    monkeypatch.setattr(fp8.grouped, "_body_mode_override", None)
    compile_module = sys.modules.get("orchestration.training.compile")
    if compile_module is not None:
        monkeypatch.setattr(compile_module, "_BODIES_SET_EAGER_FOR_GRAPHS", False)
    yield
