import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background by a non-interactive shell inherits SIGINT ignored (POSIX), and every launcher
# it starts would too: the tests that press Ctrl-C on a run (send SIGINT) then saw it train on for 120 s. A handler
# is reset to the default at exec, an ignored signal is not: give this process the handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Every process this test session starts carries SESSION_MARK in its environment (children inherit it: launchers,
# `ray start` nodes, Ray's raylet, GCS, dashboard and workers), and a job started through `isolated_env` also its
# own TEST_MARK. Cleanup finds a test's processes by that mark, never by name: other users' Ray clusters on the
# machine are not ours to stop.
SESSION_MARK_ENV, TEST_MARK_ENV = "ELASTIC_FP8_TEST_SESSION", "ELASTIC_FP8_TEST"
SESSION_MARK = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ[SESSION_MARK_ENV] = SESSION_MARK
RAY_SERVICES = ("raylet", "gcs_server")


def repo_on_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the repository first on PYTHONPATH and what was there kept: a child
    `python -c` imports the product from a source checkout, and a Python whose packages come from PYTHONPATH (an
    offline install with pip --target, as on an air-gapped GPU machine) still finds them."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


@contextlib.contextmanager
def size_limited_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A real small disk: a tmpfs of `size` (mount's -o size=, e.g. "14m") at `mount`, unmounted at the end; the
    test is skipped where mounting needs root and this is not root (CI runs as root)."""
    mount.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=False,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


# The environment of jobs written for the embedded CPU cluster (2 gloo workers, the demo's data shape), on any
# machine: the GPUs hidden (CUDA_VISIBLE_DEVICES empty, which ROCm's torch honours too), since on a GPU machine the
# launcher would plan one GPU worker per card instead. The GPU machine's own default job is
# tests/test_gpu_default_job.py's, which gives the devices back.
CPU_CLUSTER_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def launch_env(tmp: Path, **extra: str) -> dict:
    """The environment of a launched job: W&B offline under `tmp`, Ray's token authentication off (isolated_env
    says why), usage stats off, GPUs hidden (CPU_CLUSTER_ENV); `extra` adds or replaces keys. Module-scoped
    fixtures use it directly; a test's own jobs get isolated_env, which builds on it."""
    return {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp / "wandb"), "RAY_AUTH_MODE": "disabled",
            "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0", **CPU_CLUSTER_ENV, **extra}


def marked_processes(name: str, value: str) -> dict[int, str]:
    """pid -> command line of every process whose environment has name=value (this process left out)."""
    needle = f"{name}={value}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return {pid: cmd for pid, cmd in found.items() if cmd}  # zombies have no command line


def ray_services(processes: dict[int, str]) -> dict[int, str]:
    return {pid: cmd for pid, cmd in processes.items()
            if any(Path(cmd.split(" ", 1)[0]).name.startswith(s) for s in RAY_SERVICES)}


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[1])


def stop_marked(name: str, value: str, grace_s: float = 10.0, spare_children_of: int | None = None) -> dict[int, str]:
    """SIGTERM every process carrying the mark (but the direct children of `spare_children_of`), SIGKILL what is
    left after grace_s. Returns what was found."""
    def targets() -> dict[int, str]:
        found = marked_processes(name, value)
        return {pid: cmd for pid, cmd in found.items()
                if spare_children_of is None or parent_pid(pid) != spare_children_of}

    found = targets()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while targets() and time.monotonic() < deadline:
            time.sleep(0.2)
    return found


@pytest.fixture(scope="session", autouse=True)
def stop_what_the_session_left():
    """Backstop for module-scoped fixtures: nothing a job started by this session leaves outlives it. This process's
    own children are left to their owners' exit handlers (W&B's service, an in-process cluster's ray.shutdown);
    what a launcher that died left behind is no longer its child."""
    yield
    stop_marked(SESSION_MARK_ENV, SESSION_MARK, grace_s=5.0, spare_children_of=os.getpid())


@pytest.fixture
def isolated_env(tmp_path):
    """Environment for launching jobs: W&B, Ray's temp dir and caches private to the test; the test's processes
    stopped when it ends, passed or failed.

    Token authentication is off here (RAY_AUTH_MODE=disabled): the elastic tests join `ray start` nodes, which
    need the head's token on every node; the tests of the default setting (token on: tests/test_dashboard_live.py,
    tests/test_hardening_ray.py's Ctrl-C test) remove this key. RAY_TMPDIR is short because Ray's unix sockets live
    under it and their paths must stay under 107 characters.
    GPUs are hidden (CPU_CLUSTER_ENV)."""
    ray_tmpdir = tempfile.mkdtemp(prefix="rt_", dir="/tmp")
    mark = uuid.uuid4().hex
    env = launch_env(tmp_path, WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
                     WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
                     RAY_TMPDIR=ray_tmpdir, **{TEST_MARK_ENV: mark})
    try:
        yield env
    finally:
        stop_marked(TEST_MARK_ENV, mark)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)


def launch(env: dict, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run launch.py in a subprocess (its own Ray cluster, cleaned up by launch.py itself)."""
    proc = subprocess.run([sys.executable, str(REPO / "launch.py"), *overrides], check=False, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)
    return proc


def ray_services_still_up(env: dict, timeout_s: float = 30) -> dict[int, str]:
    """The Ray services (raylet, GCS) of the jobs started with `env` (isolated_env) still running after waiting up to
    timeout_s for them to exit (they exit asynchronously after ray.shutdown())."""
    deadline = time.monotonic() + timeout_s
    while (left := ray_services(marked_processes(TEST_MARK_ENV, env[TEST_MARK_ENV]))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def no_ray_leftovers(isolated_env):
    """Fails the test when its Ray cluster is still up 30 s after it ended; isolated_env then stops it either way."""
    yield
    left = ray_services_still_up(isolated_env)
    assert not left, f"Ray processes left behind: {left}"


@pytest.fixture
def another_ray_instance_on_the_host():
    """What Ray's address lookup sees on a host where another Ray cluster runs (another user's, another test's): a
    second raylet process naming its GCS address. Ray finds local clusters by the raylet's executable name and its
    --gcs-address argument; this process is a sleeping Python under that name, on a port nothing listens on."""
    from tests.spawned import free_port

    proc = subprocess.Popen(["raylet", "-c", "import time; time.sleep(3600)", f"--gcs-address=127.0.0.1:{free_port()}"],
                            executable=sys.executable)
    try:
        yield
    finally:
        proc.kill()
        proc.wait(timeout=30)


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
