"""The job plan printed by dry runs and checked before every launch: sizes, memory per worker, fits or not.

Built from a meta-device model (models.planning), so nothing is allocated: planning DeepSeek-V3 on a laptop works.
"""

from __future__ import annotations

from typing import Any

from orchestration.config import JobConfig
from orchestration.training.elastic import plan_batch

GIB = 1024**3


def build_job_plan(job: JobConfig) -> dict[str, Any]:
    from models.planning import plan_model
    from models.registry import resolve_flavor
    from orchestration.driver.ray_job import ray_plan, resolve_run_root

    c = job.cluster
    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    # The smallest world size is the worst case for per-worker memory (fewest shards).
    world = c.min_workers
    batch = plan_batch(job.train.global_batch_size, job.train.micro_batch_size, world)
    sharding = job.train.sharding if world > 1 else "none"
    model_plan = plan_model(flavor, world_size=world, seq_len=job.data.seq_len, micro_batch=batch.micro_batch_size,
                            sharding="fsdp" if sharding == "fsdp" else "replicate",
                            activation_checkpointing=job.model.activation_checkpointing,
                            param_dtype_bytes=4 if job.precision.fsdp_param_dtype == "float32" else 2)
    memory_bytes = int(c.memory_per_worker_gb * GIB)
    mp = model_plan.to_dict(memory_bytes)
    bytes_per_worker = int(mp["bytes_per_worker"]["total"])
    fits = bool(mp["fits"])
    reasons = [f"{job.model.name} at world size {world} ({sharding}, micro-batch {batch.micro_batch_size} x seq "
               f"{job.data.seq_len}) on cluster '{c.name}' ({c.memory_per_worker_gb:.1f} GiB per worker): "
               + mp["reasons"][0], *mp["reasons"][1:]]
    if not fits:
        reasons.append(_suggestion(job))
    run_name = job.run_name or f"{job.model.name}-{job.precision.name}-<timestamp>"
    return {
        "model": job.model.name,
        "precision": job.precision.name,
        "recipe": job.precision.recipe,
        "total_params": int(mp["total_params"]),
        "active_params": int(mp["active_params"]),
        "flops_per_token": mp.get("flops_per_token"),
        "world_size_min": c.min_workers,
        "world_size_max": c.max_workers,
        "global_batch_tokens": job.train.global_batch_size * job.data.seq_len,
        "micro_batch_size": batch.micro_batch_size,
        "grad_accum": batch.grad_accum,
        "bytes_per_worker": bytes_per_worker,
        "bytes_breakdown": mp["bytes_per_worker"],
        "memory_per_worker_bytes": memory_bytes,
        "fits": fits,
        "reasons": reasons,
        "model_plan": mp,
        "ray": ray_plan(job, run_name, resolve_run_root(job)).to_dict(),
    }


def _suggestion(job: JobConfig) -> str:
    options = []
    if job.model.name.startswith(("llama3", "deepseek")):
        options.append("model=debug_moe or model=debug_dense for this machine")
    if not job.model.activation_checkpointing:
        options.append("model.activation_checkpointing=true")
    options.append("more workers (cluster.min_workers) to shard parameters and optimizer states further")
    if job.cluster.device == "cpu":
        options.append("GPU workers, e.g. cluster=aws_h200 (141 GB each)")
    return "suggestion: " + "; ".join(options)


def print_plan(plan: dict[str, Any]) -> None:
    print(f"model {plan['model']}  precision {plan['precision']}  params {plan['total_params'] / 1e9:.3f}B total, "
          f"{plan['active_params'] / 1e9:.3f}B active")
    print(f"workers {plan['world_size_min']}..{plan['world_size_max']}  global batch {plan['global_batch_tokens']:,} "
          f"tokens  micro-batch {plan['micro_batch_size']} x grad-accum {plan['grad_accum']}")
    breakdown = plan["bytes_breakdown"]
    if isinstance(breakdown, dict):
        parts = "  ".join(f"{k} {v / GIB:.2f}" for k, v in breakdown.items() if isinstance(v, (int, float)))
        print(f"GiB per worker: {parts}")
    for reason in plan["reasons"]:
        print(reason)
