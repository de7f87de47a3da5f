"""The optimizer of the worker loop: AdamW (torch's, or optim.ChunkedAdamW's one-launch Triton step) and the LR
schedule, a pure function of the global step."""

from __future__ import annotations

import math
from typing import Any

import torch

from fp8.fsdp_allgather import is_fp8_all_gather_weight
from fp8.linear import Float8Linear
from fp8.weight_amax import fresh_weight_amax, start_keeping
from optim import ChunkedAdamW
from orchestration.config import JobConfig


def lr_at(step: int, job: JobConfig) -> float:
    """Linear warmup then cosine to min_lr_ratio, a function of the global step only (continues across restarts)."""
    t = job.train
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, job: JobConfig, step: int, lr_scale: float) -> None:
    """The learning rate the next step trains with: the schedule at the global step `step` times the scale a
    rollback left in force. Set after every step, after a load and after a rollback (which changes the scale)."""
    for group in optimizer.param_groups:
        group["lr"] = job.train.lr * lr_at(step, job) * lr_scale


def adamw_kwargs(job: JobConfig, device: torch.device) -> dict[str, Any]:
    """AdamW's settings. Fused on GPUs: one multi-tensor kernel per step for all parameters instead of torch's
    default foreach chain (about a dozen launches, and their host time, where the MoE step's GPU already waits on
    the host before the optimizer, BENCHMARKS.md); torchtitan's default, and what benchmarks/train_step.py
    times. CPU runs keep torch's default implementation. A resumed run takes the implementation its checkpoint was
    saved with (torch restores a param group's settings with its state)."""
    return {"lr": job.train.lr, "betas": (job.train.beta1, job.train.beta2), "weight_decay": job.train.weight_decay,
            "fused": True if device.type == "cuda" else None}


def adamw_implementation(job: JobConfig, device: torch.device) -> str:
    """train.adamw resolved for this worker's device: "triton" (optim.ChunkedAdamW) or "torch"."""
    nvidia = device.type == "cuda" and torch.version.hip is None
    if job.train.adamw == "triton" and not nvidia:
        raise ValueError(f"train.adamw=triton runs a Triton kernel on NVIDIA GPUs; this worker's device is "
                         f"{'ROCm' if device.type == 'cuda' else device.type}: use train.adamw=auto or torch")
    if job.train.adamw == "auto":
        return "triton" if nvidia else "torch"
    return job.train.adamw


def param_groups_by_mesh(params) -> list[dict]:
    """The parameters in one group per device mesh they are DTensors on (plain tensors together): torch's fused and
    foreach AdamW run one multi-tensor op per group, and a DTensor op refuses operands on different meshes (FSDP's
    and the expert-parallel experts', orchestration/training/expert_parallel.py). One group when there is one mesh."""
    groups: dict = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return [{"params": ps} for ps in groups.values()]


class WeightAmaxKeeper:
    """The FP8 layers whose weight amax is kept (fp8.weight_amax): `weight_layers` (whole weights, checked before
    every forward of the model by its pre-hook, refresh_stale) and `shard_layers` (FSDP2 fp8 all-gather shards,
    checked by the all-gather hook)."""

    def __init__(self, weight_layers: list[torch.nn.Module], shard_layers: list[torch.nn.Module]):
        self.weight_layers, self.shard_layers = weight_layers, shard_layers

    def refresh_stale(self) -> None:
        for layer in self.weight_layers:
            fresh_weight_amax(layer, layer.weight)

    @property
    def reductions(self) -> int:
        """Amaxes reduced again since keeping started (tests read it: after kernel steps, none)."""
        return sum(layer.weight_amax_reductions for layer in (*self.weight_layers, *self.shard_layers))


def keep_weight_amax(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> WeightAmaxKeeper | None:
    """Keep the weight amax of `model`'s tensorwise FP8 layers whose weights `optimizer` steps, as whole plain tensors
    or as FSDP2 fp8 all-gather shards (fp8.weight_amax): written by ChunkedAdamW's kernel, read by the casts, reduced
    again after any other change. None when no layer qualifies (bf16, rowwise recipes, FSDP2 shards gathered in high
    precision)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    candidates = [m for m in model.modules() if isinstance(m, Float8Linear) and m.recipe.granularity == "tensorwise"
                  and id(m.weight) in stepped and m.weight_amax.dtype == torch.float32]
    weight_layers = [m for m in candidates if type(m.weight) in (torch.Tensor, torch.nn.Parameter)]
    shard_layers = [m for m in candidates if is_fp8_all_gather_weight(m.weight)]
    if not weight_layers and not shard_layers:
        return None
    keeper = WeightAmaxKeeper(weight_layers, shard_layers)
    for layers, kind in ((weight_layers, "weight"), (shard_layers, "shard")):
        for layer in layers:
            start_keeping(layer, kind)
    if isinstance(optimizer, ChunkedAdamW):
        optimizer.keep_weight_amax(weight_layers + shard_layers)
    if weight_layers:
        model.register_forward_pre_hook(lambda _module, _args: keeper.refresh_stale())
    return keeper


def make_optimizer(job: JobConfig, device: torch.device, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; the tensorwise FP8 layers' weight amax kept from step to step
    (keep_weight_amax: written by ChunkedAdamW's kernel, so their casts skip a pass over the weights)."""
    kwargs = adamw_kwargs(job, device)
    params = param_groups_by_mesh(model.parameters())
    optimizer = ChunkedAdamW(params, **kwargs) if adamw_implementation(job, device) == "triton" else \
        torch.optim.AdamW(params, **kwargs)
    keep_weight_amax(model, optimizer)
    return optimizer
