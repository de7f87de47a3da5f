"""Process groups, devices and FSDP2 sharding, applied to models from outside (models/ has no distributed code)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def pick_device(requested: str, local_rank: int) -> torch.device:
    """cpu | cuda | rocm | auto. ROCm builds of torch expose HIP devices through the torch.cuda API."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested in ("cuda", "rocm", "auto") and torch.cuda.is_available():
        is_hip = torch.version.hip is not None
        if requested == "cuda" and is_hip:
            raise RuntimeError("cluster.device=cuda but this torch build is ROCm; use cluster.device=rocm or auto")
        if requested == "rocm" and not is_hip:
            raise RuntimeError("cluster.device=rocm but this torch build is CUDA; use cluster.device=cuda or auto")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if requested == "auto":
        return torch.device("cpu")
    raise RuntimeError(f"cluster.device={requested} but no GPU is visible to this worker")


def backend_for(device: torch.device) -> str:
    # RCCL is reached through the "nccl" backend name on ROCm builds of torch.
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(requested_device: str, timeout_s: float = 600.0) -> DistInfo:
    """Join (or reuse) the default process group. Ray Train's TorchTrainer already created one; torchrun did not."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
    elif world_size > 1:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize(model: nn.Module, world_size: int, sharding: str, param_dtype: str, reduce_dtype: str,
                activation_checkpointing: bool = False) -> nn.Module:
    """FSDP2: one fully_shard per transformer block, then the root. No-op on a single worker."""
    from models.deepseek_moe import set_forward_recompute

    set_forward_recompute(model, activation_checkpointing)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
    if world_size <= 1 or sharding == "none":
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    for block in model.layers.values():
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def all_reduce_grads_if_unsharded(model: nn.Module, world_size: int, sharding: str) -> None:
    """With sharding=none, average gradients by hand (one flat all-reduce) so ranks stay identical."""
    if world_size <= 1 or sharding != "none":
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def local_grad_norm(model: nn.Module, device: torch.device) -> torch.Tensor:
    """L2 norm of this rank's gradient shards (no collective): one fused multi-tensor kernel."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())


def global_grad_norm(local_norm: torch.Tensor, world_size: int, sharding: str) -> torch.Tensor:
    """L2 norm of the whole model's gradient from this rank's local one (local_grad_norm).

    Under FSDP2 each rank holds a disjoint shard of every gradient, so the squares add across ranks: one scalar
    all-reduce. Unsharded (one worker, or sharding=none after all_reduce_grads_if_unsharded) every rank holds the
    whole gradient and the local norm is the global one. The worker needs the local norm anyway (which rank went
    non-finite), so deriving the global norm from it saves the second pass over every gradient that
    clip_grad_norm_ would make. A non-finite shard makes the result non-finite on every rank, as clip_grad_norm_'s.
    """
    if world_size <= 1 or sharding == "none":
        return local_norm
    squares = local_norm.float().square()
    dist.all_reduce(squares)
    return squares.sqrt()
