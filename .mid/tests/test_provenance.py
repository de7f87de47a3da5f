"""A run directory records how its run was started (git commit and dirty flag, command line, Hydra overrides), and
the jobs of one multirun land in one sweep directory that the report takes."""

import subprocess

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from orchestration.config import JobConfig
from orchestration.driver import ray_job
from orchestration.observability.events import EVENTS_FILE, read_jsonl
from orchestration.observability.provenance import git_state
from orchestration.observability.run_data import expand_run_dirs
from tests.conftest import REPO


def test_git_state_of_a_clean_and_a_changed_checkout(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    assert git_state(tmp_path) == {"git_commit": None, "git_dirty": None}  # not a checkout
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("not part of the code")
    assert git_state(tmp_path) == {"git_commit": head, "git_dirty": False}
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_state(tmp_path) == {"git_commit": head, "git_dirty": True}


@pytest.fixture
def multirun_job():
    """Hydra's own config of job `num` of a multirun, as Hydra sets it while the job runs."""
    def set_job(num: int, *overrides: str) -> None:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.job.num = num
        cfg.hydra.overrides.task = list(overrides)
        HydraConfig.instance().set_config(cfg)

    yield set_job
    HydraConfig.instance().cfg = None
    ray_job._SWEEP_NAME = None


def test_multirun_jobs_share_a_sweep_directory_and_record_their_overrides(tmp_path, multirun_job):
    from orchestration.validation import resolve_defaults

    run_dirs = []
    for num, precision in enumerate(("bf16", "fp8")):
        multirun_job(num, f"precision={precision}")
        job = JobConfig(run_root=str(tmp_path))
        resolve_defaults(job)  # what loading a config does: the machine-decided settings (no GPU here)
        job = ray_job.in_sweep_directory(job)
        run_dirs.append(ray_job.open_run_dir(job, job.run_name).path)
    sweep = run_dirs[0].parent
    assert sweep.parent == tmp_path and sweep.name.startswith("sweep-") and run_dirs[1].parent == sweep
    assert [p.name for p in run_dirs] == ["0_debug_moe-fp8", "1_debug_moe-fp8"]  # JobConfig's own model/precision
    assert expand_run_dirs([sweep]) == run_dirs  # the report takes the sweep directory
    start = read_jsonl(run_dirs[1] / EVENTS_FILE)[0]
    assert start["event"] == "run_start" and start["overrides"] == ["precision=fp8"] and start["sweep_job"] == 1
    assert start["git_commit"] == git_state(REPO)["git_commit"] and isinstance(start["git_dirty"], bool)
    assert "pytest" in start["command"]


def test_a_single_run_stays_where_it_was():
    job = JobConfig(run_root="/x", run_name="r")
    assert ray_job.in_sweep_directory(job) is job
