"""The job plan printed by dry runs and checked before every launch: sizes, memory per worker, fits or not.

Built from a meta-device model (models.planning), so nothing is allocated: planning DeepSeek-V3 on a laptop works.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from orchestration.config import JobConfig
from orchestration.machine_defaults import is_gpu_job
from orchestration.training.elastic import plan_batch

GIB = 1024**3


def build_job_plan(job: JobConfig, machine_notes: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The plan of a resolved job; machine_notes: what the machine decided (orchestration/machine_defaults.py),
    printed first."""
    from models.registry import build_model, resolve_flavor
    from orchestration.driver.ray_job import ray_plan
    from orchestration.driver.start_checks import checkpoint_bytes, resolve_run_root
    from orchestration.training.model_setup import plan_fp8, plan_worker_memory

    c = job.cluster
    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    meta_model = build_model(flavor, device="meta")
    # The layers the workers convert: the size rule at the configured micro-batch, whatever the world size.
    fp8_layers = plan_fp8(job, on_gpu=is_gpu_job(job), model=meta_model)
    # The smallest world size is the worst case for per-worker memory (fewest shards).
    world = c.min_workers
    batch = plan_batch(job.train.global_batch_size, job.train.micro_batch_size, world)
    sharding = job.train.sharding if world > 1 else "none"
    model_plan = plan_worker_memory(job, world, batch.micro_batch_size, flavor, meta_model, fp8_layers.converted)
    memory_bytes = int(c.memory_per_worker_gb * GIB)
    mp = model_plan.to_dict(memory_bytes)
    bytes_per_worker = int(mp["bytes_per_worker"]["total"])
    fits = bool(mp["fits"])
    reasons = [f"{job.model.name} at world size {world} ({sharding}, micro-batch {batch.micro_batch_size} x seq "
               f"{job.data.seq_len}) on cluster '{c.name}' ({c.memory_per_worker_gb:.1f} GiB per worker): "
               + mp["reasons"][0], *mp["reasons"][1:]]
    workers_needed = None
    if not fits:
        workers_needed = smallest_fitting_workers(job, batch.micro_batch_size)
        reasons.append(_suggestion(job, workers_needed))
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
        "checkpoint_bytes": checkpoint_bytes(job),
        "fits": fits,
        "reasons": reasons,
        "workers_needed": workers_needed,
        "fp8_layers": fp8_layer_plan(job, fp8_layers),
        "layouts": elastic_layouts(job),
        "machine": list(machine_notes),
        "scaling": scaling_plan(job) if c.fabric != "none" else None,
        "model_plan": mp,
        "ray": ray_plan(job, run_name, resolve_run_root(job)).to_dict(),
    }


def elastic_layouts(job: JobConfig) -> dict[str, str]:
    """The parallel layout each world size of the elastic range runs (orchestration.training.elastic.plan_layout, as
    the workers pick it at every (re)start), by world size; at most 64 sizes listed (the smallest ones)."""
    from models.registry import resolve_flavor
    from orchestration.training.elastic import layout_for

    c = job.cluster
    experts = getattr(resolve_flavor(job.model.name, dict(job.model.overrides)).args, "n_routed_experts", 0)
    sizes = range(c.min_workers, min(c.max_workers, c.min_workers + 63) + 1)
    return {str(n): layout_for(job, n, experts).describe() for n in sizes}


def scaling_workload(job: JobConfig):
    """models.scaling.Workload of this job on one GPU: parameter counts and FLOPs from a meta-built model, compute
    from the product's single-GPU step measured for the model family (models.scaling.MEASURED_STEPS; a family without
    one has none: the job's model must be one of those or derive from their flavors)."""
    from torch import nn

    from models import scaling
    from models.planning import count_params, flops_per_token
    from models.registry import build_model, resolve_flavor
    from orchestration.training.model_setup import planned_recipe

    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    measured = next((m for m in scaling.MEASURED_STEPS.values()
                     if resolve_flavor(m.flavor).family == flavor.family), None)
    if measured is None:
        raise ValueError(f"no single-GPU step measured for the {flavor.family} family: scaling needs one "
                         f"(models.scaling.MEASURED_STEPS: {sorted(scaling.MEASURED_STEPS)})")
    model = build_model(flavor, device="meta")
    counts = count_params(model)
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    # What the FP8 all-gather sends in fp8: the weights of the blocks' dense linears (not the routed experts, not
    # routers), when the recipe is tensorwise (fp8.fsdp_allgather).
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if name.startswith("layers.") and type(m) is nn.Linear and not name.endswith(("gate", "router")))
    layer_params = counts.total - root
    m_model = build_model(resolve_flavor(measured.flavor, measured.overrides), device="meta")
    tokens = job.train.micro_batch_size * job.data.seq_len
    recipe = planned_recipe(job)
    # model.activation_checkpointing wraps each whole block: its forward runs again in backward. The profile's dense
    # GEMMs are the nn.Linear ones (routed experts run grouped GEMMs).
    dense = sum(m.weight.numel() for m in m_model.modules() if type(m) is nn.Linear)
    w = scaling.workload_from_measurement(
        job.model.name, measured, flops_per_token(m_model, measured.seq_len), flops_per_token(model, job.data.seq_len),
        tokens, len(model.layers), counts.total, root, linear / layer_params if recipe == "tensorwise" else 0.0,
        head_flops_per_token=6 * model.output.weight.numel(),
        recompute_fraction=1.0 if job.model.activation_checkpointing else 0.0,
        measured_head_flops_per_token=6 * m_model.output.weight.numel(),
        measured_head_gemm_share=m_model.output.weight.numel() / dense)
    moe = model.moe_layers() if hasattr(model, "moe_layers") else []
    if moe:
        w = dataclasses.replace(w, expert_params=float(sum(p.numel() for m in moe for p in m.experts.parameters())),
                                moe_layers=len(moe), dim=flavor.args.dim, top_k=flavor.args.n_activated_experts)
    return w, recipe, measured


def scaling_plan(job: JobConfig) -> dict[str, Any]:
    """Predicted step time, tokens/s per GPU, MFU and scaling efficiency from 1 to 1,024 GPUs on cluster.fabric, for
    bf16 and fp8 (with and without the FP8 all-gather), at micro_batch_size x seq_len tokens per GPU (weak scaling)."""
    from models import scaling

    fabric = scaling.FABRICS[job.cluster.fabric]
    w, recipe, measured = scaling_workload(job)
    gather = 4 if job.precision.fsdp_gather_dtype() == "float32" else 2
    reduce = 4 if job.precision.fsdp_reduce_dtype == "float32" else 2
    precisions = [scaling.Precision(False, False, gather, reduce), scaling.Precision(True, False, gather, reduce)]
    if recipe == "tensorwise":
        precisions.append(scaling.Precision(True, True, gather, reduce))
    at = job.cluster.max_workers
    layout = layout_plan(job, w, precisions[-1], fabric, at)
    chosen = scaling.Layout(layout["shard_group_size"], layout["expert_parallel"], job.train.expert_dispatch_fp8)
    curves = {p.label: [s.to_dict() for s in scaling.scaling_curve(w, p, fabric, layout=chosen)] for p in precisions}
    return {"fabric": fabric.name, "fabric_description": fabric.description, "accelerator": fabric.accelerator,
            "tokens_per_gpu": w.tokens_per_gpu, "measured_from": measured.source, "world_size": at,
            "layout": layout,
            "at_world_size": {p.label: scaling.predict_step(w, p, fabric, at, chosen).to_dict() for p in precisions},
            "curves": curves}


def layout_plan(job: JobConfig, w, precision, fabric, world_size: int) -> dict[str, Any]:
    """The layout the dry run predicts at world_size: the configured one (train.sharding, shard_group_size,
    expert_parallel) when it is not the default, else the fastest candidate that fits the GPU's memory
    (models.scaling.choose_layout: FSDP or HSDP by node, expert parallelism over powers of two); with the memory
    per GPU, the predicted scaling efficiency, and every candidate."""
    from models import scaling
    from models.planning import activation_bytes
    from models.registry import build_model, resolve_flavor

    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    model = build_model(flavor, device="meta")
    activations = activation_bytes(model, w.tokens_per_gpu, 2, checkpointing=job.model.activation_checkpointing)
    buffers = 0.0  # counted with the states (models.scaling.state_bytes_per_gpu)
    experts = getattr(flavor.args, "n_routed_experts", 0)
    memory = job.cluster.memory_per_worker_gb * GIB
    best, pred, rows = scaling.choose_layout(w, precision, fabric, world_size, experts, memory, activations + buffers)
    configured = job.train.sharding != "fsdp" or job.train.expert_parallel > 1
    if configured:
        from orchestration.training.elastic import layout_for

        chosen = layout_for(job, world_size, experts, gpus_per_node=fabric.gpus_per_node)
        best = scaling.Layout(chosen.shard_group_size if chosen.sharding == "hsdp" else None, chosen.expert_parallel,
                              job.train.expert_dispatch_fp8)
        pred = scaling.predict_step(w, precision, fabric, world_size, best)
    one = scaling.predict_step(w, precision, fabric, 1).tokens_per_s_per_gpu
    return {"label": best.label(world_size), "source": "configured" if configured else "chosen",
            "shard_group_size": best.shard_group_size, "expert_parallel": best.expert_parallel,
            "precision": precision.label,
            "bytes_per_gpu": scaling.state_bytes_per_gpu(w, best, world_size) + activations + buffers,
            "fits": scaling.state_bytes_per_gpu(w, best, world_size) + activations + buffers <= 0.9 * memory,
            "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu, "scaling_efficiency": pred.tokens_per_s_per_gpu / one,
            "candidates": rows}


def print_scaling(scaling_plan_: dict[str, Any]) -> None:
    sp = scaling_plan_
    lay = sp.get("layout")
    if lay:
        print(f"layout at {sp['world_size']} GPUs ({lay['source']}): {lay['label']}, "
              f"{lay['bytes_per_gpu'] / GIB:.1f} GiB per GPU ({'fits' if lay['fits'] else 'does not fit'}), "
              f"{lay['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
              f"({lay['precision']}), scaling efficiency {lay['scaling_efficiency']:.0%}")
    print(f"scaling on {sp['fabric']} ({sp['fabric_description']}), {sp['tokens_per_gpu']:,} tokens per GPU a step, "
          f"compute from {sp['measured_from']}")
    labels = list(sp["curves"])
    print("GPUs  " + "  ".join(f"{label:>34s}" for label in labels))
    print("      " + "  ".join(f"{'step s  tok/s/GPU   MFU  scaling':>34s}" for _ in labels))
    for i, row in enumerate(sp["curves"][labels[0]]):
        cells = []
        for label in labels:
            r = sp["curves"][label][i]
            cells.append(f"{r['step_s']:7.3f} {r['tokens_per_s_per_gpu']:10,.0f} {r['mfu']:5.2f} "
                         f"{r['scaling_efficiency']:8.2f}")
        print(f"{row['world_size']:4d}  " + "  ".join(f"{c:>34s}" for c in cells))


def smallest_fitting_workers(job: JobConfig, micro_batch: int, limit: int = 1 << 16) -> int | None:
    """The fewest FSDP workers of this cluster's memory that fit the model at this micro-batch (memory per worker
    only falls as workers are added: doubling, then bisection), or None when even `limit` do not."""
    from models.registry import build_model, resolve_flavor
    from orchestration.training.model_setup import plan_fp8, plan_worker_memory

    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    model = build_model(flavor, device="meta")
    memory = int(job.cluster.memory_per_worker_gb * GIB)
    converted = plan_fp8(job, on_gpu=is_gpu_job(job), model=model).converted

    def fits(world: int) -> bool:
        return plan_worker_memory(job, world, micro_batch, flavor, model, converted).fits(memory)

    high = 1
    while not fits(high):
        if high >= limit:
            return None
        high *= 2
    low = high // 2  # does not fit (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _suggestion(job: JobConfig, workers_needed: int | None) -> str:
    options = []
    gpu = is_gpu_job(job)
    if workers_needed is not None and workers_needed > job.cluster.min_workers:
        unit = f"GPUs of {job.cluster.memory_per_worker_gb:g} GiB" if gpu else \
            f"workers of {job.cluster.memory_per_worker_gb:g} GiB"
        options.append(f"{job.model.name} needs >= {workers_needed} {unit} (FSDP; this cluster has "
                       f"{job.cluster.max_workers}): join a cluster that large (cluster.address, docs/deploy.md)")
    if job.model.name.startswith(("llama3", "deepseek")):
        if gpu:
            options.append("for a smoke test on this machine, fewer layers: +model.overrides.n_layers=4")
        else:
            options.append("model=debug_moe or model=debug_dense for this machine")
    if not job.model.activation_checkpointing:
        options.append("model.activation_checkpointing=true")
    options.append("more workers (cluster.min_workers) to shard parameters and optimizer states further")
    if not gpu:
        options.append("GPU workers, e.g. cluster=aws_h200 (141 GB each)")
    return "suggestion: " + "; ".join(options)


def fp8_layer_plan(job: JobConfig, layers=None) -> dict[str, Any]:
    """How many layers could train in FP8, how many do, and which stay bf16 with their size
    (orchestration.training.model_setup.plan_fp8, what the workers convert; `layers`: its result, where the caller
    has it already)."""
    from orchestration.training.model_setup import plan_fp8

    if layers is None:
        layers = plan_fp8(job, on_gpu=is_gpu_job(job))
    return {"eligible": layers.eligible, "converted": len(layers.converted), "kept_bf16": layers.kept_bf16}


def fp8_line(plan: dict[str, Any]) -> str | None:
    """How many layers train in FP8 and why the others stay bf16; None when the job has no FP8-eligible layer."""
    layers = plan.get("fp8_layers") or {}
    if not layers.get("eligible"):
        return None
    kept = layers["kept_bf16"]
    line = f"fp8: {layers['converted']} of {layers['eligible']} layers"
    if kept:
        sizes = sorted(set(kept.values()))
        line += (f"; {len(kept)} stay bf16, too small for FP8 to pay at micro-batch x seq_len tokens "
                 f"({'; '.join(sizes)})")
    return line


def start_lines(plan: dict[str, Any]) -> list[str]:
    """What a run prints before it starts: what the machine decided (cluster, data shape) and the FP8 layer count.
    `plan`: build_job_plan's, or any dict with its "machine" and "fp8_layers" (the torchrun launcher's)."""
    return [*plan.get("machine", ()), *filter(None, [fp8_line(plan)])]


def plan_record(plan: dict[str, Any]) -> dict[str, Any]:
    """The same facts for the run_start event in events.jsonl."""
    return {"machine": list(plan.get("machine", ())), "fp8_layers": plan.get("fp8_layers")}


def print_plan(plan: dict[str, Any]) -> None:
    for note in plan.get("machine", ()):
        print(note)
    print(f"model {plan['model']}  precision {plan['precision']}  params {plan['total_params'] / 1e9:.3f}B total, "
          f"{plan['active_params'] / 1e9:.3f}B active")
    print(f"workers {plan['world_size_min']}..{plan['world_size_max']}  global batch {plan['global_batch_tokens']:,} "
          f"tokens  micro-batch {plan['micro_batch_size']} x grad-accum {plan['grad_accum']}")
    if line := fp8_line(plan):
        print(line)
    breakdown = plan["bytes_breakdown"]
    if isinstance(breakdown, dict):
        parts = "  ".join(f"{k} {v / GIB:.2f}" for k, v in breakdown.items() if isinstance(v, (int, float)))
        print(f"GiB per worker: {parts}")
    for reason in plan["reasons"]:
        print(reason)
    layouts = plan.get("layouts") or {}
    if len(set(layouts.values())) > 1 or any(text != f"FSDP over {n}" for n, text in layouts.items()):
        print("layout by world size: " + "; ".join(f"{n}: {text}" for n, text in layouts.items()))
    if plan.get("scaling"):
        print_scaling(plan["scaling"])
