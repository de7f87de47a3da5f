"""dry_run=true: meta build, PLAN json as the last stdout line; non-fitting models stop before allocating."""

import json
import math

import pytest
import yaml

from tests.conftest import launch

PLAN_KEYS = {"model", "precision", "total_params", "active_params", "world_size_min", "world_size_max",
             "global_batch_tokens", "bytes_per_worker", "fits", "reasons"}


def last_plan(stdout: str) -> dict:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("PLAN "), last
    return json.loads(last[len("PLAN "):])


def test_dry_run_deepseek_moe16b_plans_without_allocating(isolated_env):
    proc = launch(isolated_env, "model=deepseek_moe16b", "precision=fp8", "dry_run=true", timeout=180)
    # A plan that does not fit is an error, dry run or not: exit 3 with the plan and its reasons.
    assert proc.returncode == 3, proc.stderr[-2000:]
    plan = last_plan(proc.stdout)
    assert PLAN_KEYS <= set(plan)
    assert plan["model"] == "deepseek_moe16b"
    # The exact counts (tests/test_planning.py and the meta-built model in tests/test_models_moe.py pin the same).
    assert plan["total_params"] == 16_375_728_128 and plan["active_params"] == 2_828_650_496
    assert plan["fits"] is False  # 16B params + AdamW states on 2 CPU workers of 8 GiB
    assert plan["global_batch_tokens"] == 16 * 128  # no GPU here: the CPU demo's shape
    assert plan["machine"] and "CPU workers" in plan["machine"][0]
    # The reason names what does not fit: here activations and FSDP's buffers already leave no room for the states.
    assert any("leave no room" in r and "optimizer states" in r for r in plan["reasons"]), plan["reasons"]
    assert "Run directory" not in proc.stdout  # no run was started


def test_dry_run_of_eight_80gb_gpus_fits_deepseek_moe16b_at_its_context_length(isolated_env):
    """The issue's second dry run: GPUs planned on a CPU machine, everything else left to the model."""
    proc = launch(isolated_env, "model=deepseek_moe16b", "precision=fp8", "cluster.device=cuda",
                  "cluster.min_workers=8", "cluster.max_workers=8", "cluster.memory_per_worker_gb=80", "dry_run=true",
                  timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = last_plan(proc.stdout)
    assert plan["fits"] is True
    assert plan["model_plan"]["seq_len"] == 4096
    assert plan["ray"]["resources_per_worker"]["GPU"] == 1 and plan["ray"]["use_gpu"] is True
    # 16,384 tokens per GPU step on 8 GPUs, in sequences of 4096
    assert plan["global_batch_tokens"] == 8 * 16384
    assert plan["micro_batch_size"] * plan["grad_accum"] * 8 == 32


def test_full_moe_on_one_gpu_is_refused_with_the_gpus_it_needs_and_a_smoke_test_hint(isolated_env, tmp_path):
    """The full model on a one-GPU machine (planned here with an 80 GB GPU): refused before Ray, saying how many
    such GPUs it needs and how to run a smoke test on this one."""
    proc = launch(isolated_env, "model=deepseek_moe16b", "cluster.device=cuda", "cluster.memory_per_worker_gb=79.1",
                  "dry_run=true", timeout=180)
    assert proc.returncode == 3
    plan = last_plan(proc.stdout)
    assert plan["workers_needed"] == 6  # 16.4B params, fp32 master + grads + AdamW: 262 GB over >= 6 x 71 GiB usable
    text = " ".join(plan["reasons"])
    assert "needs >= 6 GPUs of 79.1 GiB" in text and "+model.overrides.n_layers=4" in text


def test_launch_of_a_model_that_cannot_fit_stops_with_a_suggestion(isolated_env, tmp_path):
    proc = launch(isolated_env, "model=deepseek_moe16b", f"run_root={tmp_path}", timeout=180)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "does not fit" in proc.stderr and "suggestion" in proc.stdout + proc.stderr
    assert "debug_moe" in proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written, nothing allocated


def test_dry_run_llama3_8b_counts_and_fits_on_h200_cluster(isolated_env):
    proc = launch(isolated_env, "model=llama3_8b", "dry_run=true", "cluster=aws_h200", "data.seq_len=8192",
                  "train.global_batch_size=64", "train.micro_batch_size=1", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = last_plan(proc.stdout)
    assert plan["total_params"] == 8_030_261_248
    assert plan["fits"] is True
    ray = plan["ray"]
    assert ray["use_gpu"] is True and ray["backend"] == "nccl" and ray["resources_per_worker"]["GPU"] == 1


@pytest.mark.parametrize("cluster", ["local", "aws_h200", "gcp_a3", "azure_mi300x", "kuberay", "existing"])
def test_each_cluster_config_builds_the_right_ray_plan(cluster):
    from hydra import compose, initialize_config_dir

    from orchestration.driver.ray_job import ray_plan
    from orchestration.validation import load_job_config
    from tests.conftest import REPO

    preset = yaml.safe_load((REPO / "conf" / "cluster" / f"{cluster}.yaml").read_text())
    # A global batch that splits evenly over every world size of the preset's elastic range (a preset that leaves
    # the range to the machine gets the CPU demo's 2 workers here: this machine has no GPU).
    batch = math.lcm(*range(preset.get("min_workers", 2), preset.get("max_workers", 2) + 1))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cluster={cluster}", "model=debug_dense",
                                                      f"train.global_batch_size={batch}",
                                                      "train.micro_batch_size=1"])
    job = load_job_config(cfg)
    plan = ray_plan(job, "r", REPO / "runs")
    # Written out per preset (not derived from the YAML it tests): a wrong preset file must fail here.
    local_runs = str(REPO / "runs" / "_ray")
    expected = {
        "local": (2, False, "gloo", 3, local_runs, {"CPU": 1.0}),
        "existing": (2, False, "gloo", 3, local_runs, {"CPU": 1.0}),  # resources as load_job_config assumes: no GPU
        "aws_h200": ((8, 32), True, "nccl", 20, "s3://your-bucket/elastic-fp8?region=us-east-2",
                     {"CPU": 16.0, "GPU": 1.0}),
        "gcp_a3": ((8, 32), True, "nccl", 20, "gs://your-bucket/elastic-fp8", {"CPU": 16.0, "GPU": 1.0}),
        "azure_mi300x": ((8, 32), True, "nccl", 20,  # RCCL through torch's "nccl" backend on ROCm
                         "abfss://checkpoints@youraccount.dfs.core.windows.net/elastic-fp8", {"CPU": 10.0, "GPU": 1.0}),
        "kuberay": ((8, 32), True, "nccl", 20, "/mnt/shared/elastic-fp8", {"CPU": 8.0, "GPU": 1.0}),
    }[cluster]
    assert (plan.num_workers, plan.use_gpu, plan.backend, plan.max_failures, plan.storage_path,
            plan.resources_per_worker) == expected
