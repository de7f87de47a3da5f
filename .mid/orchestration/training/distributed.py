"""FSDP2 / HSDP / expert-parallel sharding and unit-by-unit materialization, applied to models from outside (models/
has no distributed code), and the gradient norms across shards."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mesh_device_type() -> str:
    """The device type of the meshes, the one the process group's backend serves (shard_mesh says why)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def shard_mesh(world_size: int, shard_group_size: int | None = None):
    """The device mesh FSDP2 shards over, on the device type the process group's backend serves. Without one,
    fully_shard builds its mesh on the machine's accelerator whenever one is visible (torch 2.11-2.13
    _init_default_mesh), whatever the backend: a gloo job on CPU on a GPU machine then moved its parameters to the
    GPU and handed CUDA tensors to gloo (rank 0 died with SIGSEGV on an H100).

    shard_group_size None: 1-D, FSDP over every rank. Otherwise HSDP: a 2-D mesh (world / shard_group_size,
    shard_group_size) named ("replicate", "shard"); fully_shard on it shards each parameter over the consecutive ranks
    of a shard group (one node's GPUs) and all-reduces the gradient shards over the replicas, so the all-gathers stay
    on the node's fast links and only the gradients' all-reduce crosses nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    if shard_group_size is None:
        return init_device_mesh(mesh_device_type(), (world_size,))
    check_hsdp_layout(world_size, shard_group_size)
    return init_device_mesh(mesh_device_type(), (world_size // shard_group_size, shard_group_size),
                            mesh_dim_names=("replicate", "shard"))


def check_hsdp_layout(world_size: int, shard_group_size: int) -> None:
    if shard_group_size < 1 or world_size % shard_group_size:
        raise ValueError(f"train.shard_group_size={shard_group_size} must divide the world size {world_size} "
                         "(HSDP replicates whole shard groups); pick a divisor, e.g. the GPUs per node")


def shard_and_materialize(model: nn.Module, template: nn.Module, layout, seed: int, device: torch.device,
                          param_dtype: str, reduce_dtype: str, activation_checkpointing: bool, fp8_all_gather: bool,
                          fp8_dispatch: bool) -> nn.Module:
    """The meta-built model laid out as `layout` (an elastic.ParallelLayout) says (parallelize), then materialized on
    `device` with the weights of `template` (init_weights_by_unit; every replica rank 0's when unsharded)."""
    model = parallelize(model, layout.world_size, layout.sharding, param_dtype, reduce_dtype, activation_checkpointing,
                        fp8_all_gather, layout.shard_group_size, layout.expert_parallel, fp8_dispatch)
    model.parallel_layout = layout  # what this (re)start runs, for the worker's events and logs
    if layout.world_size > 1 or layout.notes:
        logger.info("parallel layout at world size %d: %s%s", layout.world_size, layout.describe(),
                    "".join(f"; {note}" for note in layout.notes))
    init_weights_by_unit(model, template, seed, device)
    broadcast_from_rank0_if_unsharded(model, layout.world_size, layout.sharding)
    return model


def parallelize(model: nn.Module, world_size: int, sharding: str, param_dtype: str, reduce_dtype: str,
                activation_checkpointing: bool = False, fp8_all_gather: bool = False,
                shard_group_size: int | None = None, expert_parallel: int = 1,
                fp8_dispatch: bool = False) -> nn.Module:
    """FSDP2: one fully_shard per transformer block, then the root. No-op on a single worker.

    fp8_all_gather: tensorwise FP8 linears' weights are all-gathered in fp8 (fp8.fsdp_allgather: one byte per
    element instead of param_dtype's, bit-equal to gathering them in high precision and casting after).
    sharding "hsdp": shard inside groups of shard_group_size ranks, replicate across them (shard_mesh).
    expert_parallel N > 1: the routed experts are split over groups of N ranks and reached by all-to-all
    (orchestration.training.expert_parallel), left out of FSDP; fp8_dispatch sends their rows in e4m3. The bytes the
    all-to-alls send are counted in model.expert_all_to_all_bytes (an AllToAllBytes)."""
    from models.deepseek_moe import set_forward_recompute

    sharded = world_size > 1 and sharding != "none"
    if expert_parallel > 1 and not sharded:
        raise ValueError(f"train.expert_parallel={expert_parallel} needs train.sharding=fsdp or hsdp and more than "
                         "one worker; set train.expert_parallel=1")
    mesh = shard_mesh(world_size, shard_group_size if sharding == "hsdp" else None) if sharded else None
    set_forward_recompute(model, activation_checkpointing)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
    if not sharded:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    expert_params: set[nn.Parameter] = set()
    if expert_parallel > 1:
        from orchestration.training.expert_parallel import AllToAllBytes, apply_expert_parallel, expert_mesh

        counter = AllToAllBytes()
        expert_params = apply_expert_parallel(model, expert_mesh(world_size, expert_parallel, mesh_device_type()),
                                              counter, fp8_dispatch)
        model.expert_all_to_all_bytes = counter
    mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    ignored = expert_params or None
    if fp8_all_gather:
        from fp8.fsdp_allgather import enable_fp8_all_gather, track_fsdp_params

        wrapped = enable_fp8_all_gather(model)
        logger.info("FSDP2 all-gathers %d FP8 linear weights in fp8", len(wrapped))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored)
    if fp8_all_gather:
        track_fsdp_params(model)
    return model


_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def _copy_full_into(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into `dst`: a plain tensor whole, an FSDP2 DTensor parameter its own shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(dst, DTensor):
        # Every rank holds the same full tensor (same seed, same device type): each keeps its own chunk, no
        # communication (src_data_rank=None).
        shard = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        dst.to_local().copy_(shard)
    else:
        dst.copy_(full)


def _copy_unit(dst: nn.Module, src: nn.Module, skip_prefix: str | None = None) -> None:
    """Copy parameters and buffers of an initialised full-size `src` into the matching (maybe sharded, maybe
    checkpoint-wrapped) `dst`, except names under skip_prefix."""
    src_tensors = {**dict(src.named_parameters()), **dict(src.named_buffers())}
    for name, tensor in [*dst.named_parameters(), *dst.named_buffers()]:
        clean = name.replace(_WRAPPER_PREFIX, "")
        if skip_prefix is not None and clean.startswith(skip_prefix):
            continue
        _copy_full_into(tensor.data if isinstance(tensor, nn.Parameter) else tensor, src_tensors[clean].detach())


@torch.no_grad()
def init_weights_by_unit(model: nn.Module, template: nn.Module, seed: int, device: torch.device) -> None:
    """Materialize `model` (built on meta, maybe sharded by `parallelize`) on `device` and initialise it with the
    weights `template.init_weights(seed)` gives, one unit at a time.

    `template` is an unsharded copy of the model on meta (taken before `parallelize`). Each unit (the root's own
    weights, then each block) is allocated full-size on the device, initialised from its own seed (models.init)
    and copied in, each rank keeping its shard, then freed: device memory holds the model's shards plus one unit,
    and the host none of it (a Llama3-70B block is 3.4 GB in fp32, the model 280 GB). The weights are the same at
    every world size on a given device type and model (CPU and CUDA random streams differ, and GPU kernels may size
    their random streams by the GPU's SM count; unsharded replicas are then made rank 0's by
    broadcast_from_rank0_if_unsharded).
    """
    from models.init import ROOT_UNIT, init_unit, layer_unit

    model.to_empty(device=device)
    # The root's own weights first (all but the blocks), then each block: one unit at a time on the device.
    for name in [None, *template.layers]:
        if name is None:
            unit, source, target, skip = ROOT_UNIT, template, model, "layers."
            template.to_empty(device=device, recurse=False)  # the root's own buffers (RoPE tables)
            for child_name, child in template.named_children():
                if child_name != "layers":
                    child.to_empty(device=device)
            if hasattr(template, "tie_weights"):
                template.tie_weights()  # to_empty per child gives tied weights separate storage
        else:
            unit, source, target, skip = layer_unit(name), template.layers[name], model.layers[name], None
            source.to_empty(device=device)
        init_unit(template, unit, seed)
        _copy_unit(target, source, skip_prefix=skip)
        source.to("meta")  # the root: its own weights freed (the blocks are still on meta)
    # FP8 health statistics are written by the first FP8 forward (fp8_health_valid says so); zero, not garbage.
    for module in model.modules():
        if hasattr(module, "fp8_health_stats"):
            module.fp8_health_stats.zero_()


def broadcast_from_rank0_if_unsharded(model: nn.Module, world_size: int, sharding: str) -> None:
    """With sharding=none every rank holds a full replica that it initialised itself; GPU random streams need not
    be bit-identical across GPU models, and gradients are only averaged, so replicas that started apart would stay
    apart. Make rank 0's the replica of every rank (FSDP2 shards are each rank's own: nothing to agree on)."""
    if world_size <= 1 or sharding != "none":
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


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


def replication(tensor: torch.Tensor) -> int:
    """On how many ranks a DTensor's local shard is repeated: the product of its mesh's sizes along the dimensions it
    is replicated on (1 for FSDP's shards and plain tensors; the replica count under HSDP or expert parallelism)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return 1
    mesh = tensor.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())


def local_grad_norm(model: nn.Module, device: torch.device) -> torch.Tensor:
    """L2 norm of this rank's gradient shards (no collective): one fused multi-tensor kernel.

    A shard repeated on R ranks (HSDP's replicas, expert-parallel replicas) counts 1/R of its square, so that the
    squares of all ranks add up to the whole gradient's (global_grad_norm)."""
    by_replication: dict[int, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            by_replication.setdefault(replication(p.grad), []).append(local)
    if not by_replication:
        return torch.zeros((), device=device)
    if list(by_replication) == [1]:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(by_replication[1])).float())
    squares = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float()).square() / r
               for r, grads in by_replication.items()]
    return torch.stack(squares).sum().sqrt()


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
