"""The machine decides what the user left unset: cluster shape from the GPUs there are, data shape from the model.

The machines here are described, not detected (this one has no GPU, and no AMD GPU exists here): a Machine is what
orchestration/driver/machine.py reads from torch or from Ray's node resources, and those readers are tested on the
text they parse and on a real Ray cluster with logical GPU resources.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from hydra import compose, initialize_config_dir

from orchestration.config import ConfigError
from orchestration.driver.machine import machine_from_ray_nodes, needs_detection, parse_probe
from orchestration.machine_defaults import NO_GPU, Machine
from orchestration.validation import resolve_job
from tests.conftest import REPO

H100 = Machine(gpu_vendor="cuda", gpu_count=1, gpu_memory_gb=79.1, gpu_name="NVIDIA H100 80GB HBM3",
               source="this machine: 1 x NVIDIA H100 80GB HBM3 (79.1 GiB)")
EIGHT_MI300X = Machine(gpu_vendor="rocm", gpu_count=8, gpu_memory_gb=191.5, gpu_name="AMD Instinct MI300X",
                       source="this machine: 8 x AMD Instinct MI300X (191.5 GiB)")


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def resolve(machine: Machine, *overrides: str, enforce: bool = True):
    return resolve_job(composed(*overrides), machine, enforce_machine=enforce)


def test_no_gpu_keeps_the_cpu_demo():
    job, notes = resolve(NO_GPU)
    c = job.cluster
    assert (c.device, c.min_workers, c.max_workers, c.gpus_per_worker, c.memory_per_worker_gb) == ("cpu", 2, 2, 0, 8)
    assert (job.data.seq_len, job.train.global_batch_size, job.train.micro_batch_size) == (128, 16, 4)
    assert notes == [("cluster: 2 CPU workers of 8 GiB (the CPU demo), since no GPU visible; cluster.device=cuda "
                      "plans GPUs")]


def test_one_h100_gives_one_gpu_worker_at_the_models_context_and_the_largest_micro_batch_that_fits():
    job, notes = resolve(H100, "model=deepseek_moe16b", "+model.overrides.n_layers=4")
    c = job.cluster
    assert (c.device, c.min_workers, c.max_workers, c.gpus_per_worker, c.memory_per_worker_gb) == \
        ("cuda", 1, 1, 1.0, 79.1)
    assert job.data.seq_len == 4096  # DeepSeek-MoE's published context
    assert job.train.global_batch_size == 4  # 16,384 tokens per GPU step
    # The 4-layer model plans 52.5 GiB at micro-batch 4 (tests/test_planning.py pins the terms): all 4 at once.
    assert job.train.micro_batch_size == 4
    assert "1 x NVIDIA H100" in notes[0] and "1 cuda worker(s)" in notes[0]
    assert any(n.startswith("data.seq_len 4096") for n in notes)


def test_micro_batch_shrinks_to_what_the_memory_plan_fits_and_accumulation_makes_up_the_rest():
    small = Machine(gpu_vendor="cuda", gpu_count=1, gpu_memory_gb=56.0, gpu_name="56 GB GPU", source="test")
    job, notes = resolve(small, "model=deepseek_moe16b", "+model.overrides.n_layers=4")
    assert job.train.global_batch_size == 4
    assert job.train.micro_batch_size == 2  # 4 sequences plan 52.5 GiB > 50.4 usable; 2 plan 43.2
    assert any("x2 gradient accumulation" in n for n in notes)


def test_eight_amd_gpus_give_eight_rocm_workers_with_their_memory():
    job, notes = resolve(EIGHT_MI300X, "model=llama3_8b")
    c = job.cluster
    assert (c.device, c.min_workers, c.max_workers, c.memory_per_worker_gb) == ("rocm", 8, 8, 191.5)
    assert job.data.seq_len == 8192
    assert job.train.global_batch_size == 2 * 8  # 16,384 tokens per GPU, sequences of 8192, 8 GPUs
    assert "8 rocm worker(s)" in notes[0]


def test_every_value_the_user_sets_wins():
    job, _ = resolve(EIGHT_MI300X, "model=llama3_8b", "cluster.device=cpu", "data.seq_len=256",
                     "train.global_batch_size=24", "train.micro_batch_size=3")
    c = job.cluster
    assert (c.device, c.min_workers, c.gpus_per_worker, c.memory_per_worker_gb) == ("cpu", 2, 0, 8)
    assert (job.data.seq_len, job.train.global_batch_size, job.train.micro_batch_size) == (256, 24, 3)
    job, _ = resolve(EIGHT_MI300X, "cluster.min_workers=2", "cluster.memory_per_worker_gb=100")
    assert (job.cluster.min_workers, job.cluster.max_workers, job.cluster.memory_per_worker_gb) == (2, 8, 100)


def test_device_cuda_alone_implies_one_gpu_per_worker():
    job, _ = resolve(H100, "cluster.device=cuda")
    assert job.cluster.gpus_per_worker == 1.0
    # planned on a machine without GPUs (a dry run): one worker of an assumed 80 GB card, and the note says so
    job, notes = resolve(NO_GPU, "cluster.device=cuda", enforce=False)
    assert (job.cluster.min_workers, job.cluster.gpus_per_worker, job.cluster.memory_per_worker_gb) == (1, 1.0, 79.0)
    assert "planning only" in notes[0] and any("memory_per_worker_gb" in n for n in notes)


def test_gpus_the_machine_lacks_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"cluster.max_workers: 4 workers x 1 GPU need 4 GPUs, this machine has 1"):
        resolve(H100, "cluster.min_workers=4", "cluster.max_workers=4")
    with pytest.raises(ConfigError, match=r"cluster.device: cuda asked for, but this machine has no GPU"):
        resolve(NO_GPU, "cluster.device=cuda")
    with pytest.raises(ConfigError, match=r"cluster.device: cuda asked for, but this machine's GPUs are rocm"):
        resolve(EIGHT_MI300X, "cluster.device=cuda")
    # a dry run plans GPUs elsewhere: not refused
    job, _ = resolve(H100, "cluster.min_workers=4", "cluster.max_workers=4", enforce=False)
    assert job.cluster.min_workers == 4


def test_a_sequence_beyond_the_models_rope_range_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"data.seq_len: 8192 is beyond deepseek_moe16b's RoPE range "
                                          r"\(max_seq_len=4096\).*\+model.overrides.max_seq_len"):
        resolve(H100, "model=deepseek_moe16b", "data.seq_len=8192")


def test_gpu_conflicts_stop_launch_py_before_ray_and_touch_no_run_directory(isolated_env, tmp_path):
    """Through the real entry point on this CPU machine: cluster.device=cuda is a GPU the machine lacks."""
    run_root = tmp_path / "runs"
    (run_root / "r").mkdir(parents=True)
    (run_root / "r" / "keep.txt").write_text("saved")
    proc = subprocess.run([sys.executable, "launch.py", "cluster.device=cuda", f"run_root={run_root}", "run_name=r"],
                          check=False, cwd=REPO, env=isolated_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and "cluster.device: cuda asked for, but this machine has no GPU" in lines[0]
    assert sorted(p.name for p in (run_root / "r").iterdir()) == ["keep.txt"]
    assert "Ray" not in proc.stdout


def test_probe_output_of_torch_becomes_a_machine():
    out = json.dumps({"count": 8, "vendor": "rocm", "memory_gb": 191.98, "name": "AMD Instinct MI300X"})
    m = parse_probe("some warning\n" + out, "this machine")
    assert (m.gpu_vendor, m.gpu_count, m.gpu_memory_gb, m.has_gpus) == ("rocm", 8, 192.0, True)
    assert parse_probe(json.dumps({"count": 0}), "this machine").has_gpus is False


def test_ray_node_resources_become_a_machine():
    nodes = [{"Alive": True, "Resources": {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
             {"Alive": True, "Resources": {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
             {"Alive": False, "Resources": {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
             {"Alive": True, "Resources": {"CPU": 8.0}}]
    m = machine_from_ray_nodes(nodes)
    assert (m.gpu_vendor, m.gpu_count, m.gpu_memory_gb) == ("cuda", 16, 79.1)
    amd = machine_from_ray_nodes([{"Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:MI300X": 1.0}}])
    assert (amd.gpu_vendor, amd.gpu_memory_gb) == ("rocm", 191.5)
    assert machine_from_ray_nodes([{"Alive": True, "Resources": {"CPU": 4.0}}]).has_gpus is False


def test_only_a_config_that_leaves_the_cluster_to_the_machine_is_probed():
    assert needs_detection(composed().cluster) is True
    assert needs_detection(composed("cluster=aws_h200").cluster) is False


_HEAD = """
import json, sys, ray
ctx = ray.init(num_cpus=1, num_gpus=2, resources={"accelerator_type:H100": 1}, include_dashboard=False,
               _temp_dir=sys.argv[1])
print(json.dumps({"address": ctx.address_info["gcs_address"]}), flush=True)
sys.stdin.read()  # until the test closes stdin; then ray.shutdown at exit ends the cluster this process started
"""


@pytest.mark.slow
def test_a_joined_cluster_reads_rays_node_resources(tmp_path, monkeypatch):
    """A real Ray cluster with 2 logical GPUs of type H100 (resources only: no device is used), started by a child
    process that ends it when the test closes its stdin (no `ray stop`: it would end every Ray on the machine)."""
    from orchestration.driver.machine import detect_ray_cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # tests run Ray without token auth (conftest.isolated_env)
    temp_dir = tempfile.mkdtemp(prefix="md_", dir="/tmp")  # Ray's unix socket paths must stay under 107 characters
    head = subprocess.Popen([sys.executable, "-c", _HEAD, temp_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        address = json.loads(head.stdout.readline())["address"]
        m = detect_ray_cluster(address)
        assert (m.gpu_vendor, m.gpu_count, m.gpu_memory_gb) == ("cuda", 2, 79.1)
        job, notes = resolve(m, "cluster=existing", f"cluster.address={address}")
        assert (job.cluster.device, job.cluster.min_workers, job.cluster.memory_per_worker_gb) == ("cuda", 2, 79.1)
        assert "Ray cluster's resources: 2 x H100" in notes[0]
    finally:
        head.stdin.close()
        head.wait(timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_wider_rope_range_does_not_make_every_sequence_that_long():
    """A Hugging Face Llama 3.1 config says max_seq_len 131072: the default sequence stays the preset's 8192."""
    job, _ = resolve(H100, "model=llama3_8b", "+model.overrides.n_layers=2", "+model.overrides.max_seq_len=131072")
    assert job.data.seq_len == 8192
