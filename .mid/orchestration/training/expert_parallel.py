"""Expert parallelism for the routed experts of DeepSeek-MoE, applied from outside (models/ stays free of it).

Layout: the world of W ranks is a 2-D mesh (W / N, N) named ("ep_replicate", "ep"). The N ranks of one "ep" group
(consecutive ranks: one node's GPUs when N divides GPUs per node) each hold E / N routed experts of every MoE layer;
the W / N groups are replicas of each other. The expert weights are DTensors with placements (Replicate, Shard(0))
on that mesh, so DCP saves each expert once and reshards it into any other layout (another N, or plain FSDP).
They are left out of FSDP (fully_shard's ignored_params): the shared experts, the router, attention and the rest stay
under FSDP or HSDP.

One MoE layer's routed FFN on a rank (MoE.expert_compute, set here):
  1. the rank routes its own tokens and sorts the assignments by expert (models.deepseek_moe, unchanged);
  2. counts: an all-to-all of the per-expert row counts tells each rank how many rows it gets from each peer;
  3. dispatch: all-to-all of the rows (uneven splits: all_to_all_single with split sizes), to the rank holding
     their expert; arriving rows are ordered (source rank, local expert) and regrouped by local expert;
  4. the local experts' grouped GEMM (the module's own grouped_mm: the FP8 one after fp8.convert_to_fp8);
  5. combine: the reverse all-to-all brings each row back to the rank and position it came from.
Backward runs the two all-to-alls in reverse. The expert weights' gradient on a rank holds the contributions of the
tokens of its "ep" group; an all-reduce over "ep_replicate" adds the other groups', and dividing by W makes it the
mean over ranks that FSDP gives every other gradient (each rank's loss is already weighted by its share).

FP8 dispatch (`fp8_dispatch`): the rows travel as e4m3 with one power-of-two scale per row, the same cast the FP8
grouped GEMM applies to its input (fp8.grouped: rowwise along K, powers of two), so the GEMM's forward operand is
bit-identical either way; the weight gradient then reads the dequantized rows instead of the high-precision ones.
Gradients travel back in their own dtype.

Gloo (CPU) implements all_to_all_single with uneven splits, so the CPU tests run the same code as NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

EP_MESH_DIMS = ("ep_replicate", "ep")


@dataclass
class AllToAllBytes:
    """Bytes this rank handed to the all-to-all collectives (to other ranks; its own chunk stays local), by
    direction, since the last reset. Counted from the split sizes of the real calls."""

    dispatch: int = 0  # forward: rows to the experts' ranks
    combine: int = 0  # forward: results back to the tokens' ranks
    backward: int = 0  # both all-to-alls again, reversed, in backward
    calls: int = 0
    per_layer: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.dispatch = self.combine = self.backward = self.calls = 0

    @property
    def total(self) -> int:
        return self.dispatch + self.combine + self.backward


def _sent_bytes(rows_per_peer: list[int], row_bytes: int, self_index: int) -> int:
    return sum(n for i, n in enumerate(rows_per_peer) if i != self_index) * row_bytes


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, counter: AllToAllBytes, direction: str):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.counter = out_splits, in_splits, group, counter
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        row_bytes = x[0:1].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        setattr(counter, direction, getattr(counter, direction)
                + _sent_bytes(in_splits, row_bytes, dist.get_rank(group)))
        counter.calls += 1
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        row_bytes = grad_out[0:1].numel() * grad_out.element_size() if grad_out.dim() > 1 else grad_out.element_size()
        ctx.counter.backward += _sent_bytes(ctx.out_splits, row_bytes, dist.get_rank(ctx.group))
        ctx.counter.calls += 1
        dist.all_to_all_single(grad_in, grad_out, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None, None, None


class _MeanOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the expert replicas (the ep_replicate group) and divides by
    the world size: the mean over ranks that FSDP gives the other gradients."""

    @staticmethod
    def forward(ctx, w, group, world_size: int):
        ctx.group, ctx.world_size = group, world_size
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.world_size, None, None


def _fp8_rows(x_RD: torch.Tensor):
    """(x as e4m3 bytes viewed as uint8, per-row power-of-two scales): the cast fp8.grouped applies to its input."""
    from fp8 import quant
    from fp8.backend import get_backend

    x_fp8, scale_R1 = quant.quantize_rowwise(x_RD.contiguous(), get_backend(x_RD.device).e4m3, -1, True)
    return x_fp8, scale_R1.float()


class _Fp8Dispatch(torch.autograd.Function):
    """The dispatch all-to-all with the rows in e4m3 and their scales in float32; backward sends the gradient in its
    own dtype (straight through the cast, as the FP8 GEMM's own input cast is)."""

    @staticmethod
    def forward(ctx, x_RD, out_splits, in_splits, group, counter: AllToAllBytes):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.counter = out_splits, in_splits, group, counter
        x_fp8, scale_R1 = _fp8_rows(x_RD)
        me = dist.get_rank(group)
        payload = x_fp8.view(torch.uint8)
        recv = payload.new_empty((sum(out_splits), payload.shape[1]))
        recv_scale = scale_R1.new_empty((sum(out_splits), 1))
        counter.dispatch += _sent_bytes(in_splits, payload.shape[1] + 4, me)
        counter.calls += 2
        dist.all_to_all_single(recv, payload, out_splits, in_splits, group=group)
        dist.all_to_all_single(recv_scale, scale_R1, out_splits, in_splits, group=group)
        return (recv.view(x_fp8.dtype).float() / recv_scale).to(x_RD.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty((sum(ctx.in_splits), grad_out.shape[1]))
        ctx.counter.backward += _sent_bytes(ctx.out_splits, grad_out.shape[1] * grad_out.element_size(),
                                            dist.get_rank(ctx.group))
        ctx.counter.calls += 1
        dist.all_to_all_single(grad_in, grad_out, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None, None


class ExpertParallelCompute:
    """MoE.expert_compute under expert parallelism: (x_RD sorted by global expert, offs_E over all E experts) ->
    y_RD in the same order, the rows computed on the ranks that hold their experts (module docstring).

    A plain callable, not an nn.Module: it adds no parameters or state_dict keys to the MoE layer."""

    def __init__(self, experts: nn.Module, ep_group, replicate_group, world_size: int, counter: AllToAllBytes,
                 fp8_dispatch: bool = False):
        self.experts = experts
        self.ep_group = ep_group
        self.replicate_group = replicate_group
        self.ep_size = dist.get_world_size(ep_group)
        self.world_size = world_size
        self.counter = counter
        self.fp8_dispatch = fp8_dispatch

    # Outside torch.compile: the split sizes are read on the host and the collectives run eagerly (a graph break
    # around the routed experts of a compiled block).
    @torch.compiler.disable
    def __call__(self, x_RD: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        N = self.ep_size
        E = offs_E.shape[0]
        L = E // N  # local experts
        offs64_E = offs_E.to(torch.int64)
        counts_E = torch.diff(offs64_E, prepend=offs64_E.new_zeros(1))
        send_NL = counts_E.view(N, L)
        recv_NL = torch.empty_like(send_NL)
        dist.all_to_all_single(recv_NL, send_NL, group=self.ep_group)
        # One host read of both count tables: the collectives need their split sizes on the host.
        send_N, recv_N = (t.tolist() for t in torch.stack([send_NL.sum(1), recv_NL.sum(1)]).cpu())
        if self.fp8_dispatch:
            x_recv = _Fp8Dispatch.apply(x_RD, recv_N, send_N, self.ep_group, self.counter)
        else:
            x_recv = _AllToAll.apply(x_RD, recv_N, send_N, self.ep_group, self.counter, "dispatch")
        # Arrived ordered (source rank, local expert): regroup by local expert, sources in rank order inside one.
        local_expert_r = torch.repeat_interleave(torch.arange(L, device=x_RD.device).repeat(N), recv_NL.reshape(-1))
        order_r = torch.argsort(local_expert_r, stable=True)
        offs_L = recv_NL.sum(0).cumsum(0).to(torch.int32)
        w13 = _MeanOverReplicas.apply(self.experts.w13.to_local(), self.replicate_group, self.world_size)
        w2 = _MeanOverReplicas.apply(self.experts.w2.to_local(), self.replicate_group, self.world_size)
        y_sorted = self.experts.swiglu(x_recv[order_r], offs_L, w13, w2)
        y_recv = y_sorted[torch.argsort(order_r)]
        return _AllToAll.apply(y_recv, send_N, recv_N, self.ep_group, self.counter, "combine")


def expert_mesh(world_size: int, expert_parallel: int, device_type: str):
    """The (W / N, N) mesh ("ep_replicate", "ep") the routed experts are sharded on."""
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % expert_parallel:
        raise ValueError(f"train.expert_parallel={expert_parallel} must divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // expert_parallel, expert_parallel), mesh_dim_names=EP_MESH_DIMS)


def routed_expert_modules(model: nn.Module) -> list[nn.Module]:
    """Every MoE layer of the model (modules with routed experts and an expert_compute swap point)."""
    return [m for m in model.modules() if hasattr(m, "expert_compute") and hasattr(m, "experts")]


def apply_expert_parallel(model: nn.Module, mesh, counter: AllToAllBytes, fp8_dispatch: bool = False
                          ) -> set[nn.Parameter]:
    """Shard every MoE layer's routed experts over the mesh's "ep" dimension (E / N per rank, replicated over
    "ep_replicate") and route their rows by all-to-all. The model may be on meta. Returns the expert parameters
    (for fully_shard's ignored_params)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ep_size = mesh.size(1)
    world_size = mesh.size()
    replicate_group = mesh.get_group("ep_replicate") if mesh.size(0) > 1 else None
    placements = (Replicate(), Shard(0))
    params: set[nn.Parameter] = set()
    moe_layers = routed_expert_modules(model)
    if not moe_layers:
        raise ValueError("train.expert_parallel > 1 needs a model with routed experts (a DeepSeek-MoE flavor); "
                         "set train.expert_parallel=1")
    for moe in moe_layers:
        experts = moe.experts
        if experts.n_experts % ep_size:
            raise ValueError(f"train.expert_parallel={ep_size} must divide the {experts.n_experts} routed experts")
        for name in ("w13", "w2"):
            full = getattr(experts, name)
            local_rows = full.shape[0] // ep_size
            local = torch.empty((local_rows, *full.shape[1:]), dtype=full.dtype, device=full.device)
            sharded = nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                                                      stride=full.stride()), requires_grad=full.requires_grad)
            setattr(experts, name, sharded)
            params.add(sharded)
        moe.expert_compute = ExpertParallelCompute(experts, mesh.get_group("ep"), replicate_group, world_size,
                                                   counter, fp8_dispatch)
    return params
