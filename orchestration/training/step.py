"""The training step: forward and backward over this rank's micro-batches, the gradient norm, the divergence check and
the update it allows. The worker loop (loop.py) runs `train_step` once per optimizer step and
benchmarks/train_step.py times the same function, so the headline benchmark measures the product's step.

What the step does not do is the bookkeeping around it (data cursor, LR schedule, logging, checkpoints) and the
decision's consequences beyond the update (events, precision switches, rollback): the loop owns those.

Order inside a step, and why:
1. forward_backward: every micro-batch's loss scaled by its share of the global batch, so the sum of the gradients
   over ranks is the global-batch mean whatever the split (elastic world sizes give uneven ones).
2. grad_norms: one pass over the gradients for the rank's own norm and, from it, the global norm (clip_grad_norm_
   would read them all a second time).
3. check (the divergence guard): ONE collective and ONE host read; `gated_update` lets the guard launch the clipped
   update on the device before that read, gated by the verdict, so the GPU runs the optimizer while the host decides.
4. the update, if the decision applies it and the gated launch did not: the clip scales after the decision, so a
   skipped step never scales the gradients it drops. optim.ChunkedAdamW (train.adamw) scales inside its one launch;
   with torch's AdamW the scaling pass at least keeps the GPU busy while the host runs AdamW's Python prologue (the
   GPU otherwise waited there in the MoE host profile).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from models.loss import model_lm_loss
from optim import clip_and_step
from orchestration.divergence.policy import Decision, Proceed
from orchestration.training.distributed import all_reduce_grads_if_unsharded, global_grad_norm, local_grad_norm

# check(rank loss, monitored grad norm, gated_update) -> (decision, whether gated_update applied the update)
Check = Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], bool]], tuple[Decision, bool]]


@dataclass
class StepModel:
    """What one step runs on: the (sharded, compiled, converted) model, its optimizer and how to run them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    compute_dtype: torch.dtype = torch.bfloat16  # autocast dtype of the matmuls outside the FP8 layers
    compiled: bool = False  # the loss is compiled with the blocks (models.loss.model_lm_loss)
    cuda_graphs: bool = False  # blocks replayed as CUDA graphs: each forward starts a new graph-tree iteration
    world_size: int = 1
    sharding: str = "none"  # "fsdp" (FSDP2 reduces the gradients) or "none" (an all-reduce here)
    grad_clip: float = 1.0


@dataclass(frozen=True)
class MicroBatch:
    inputs: torch.Tensor
    targets: torch.Tensor
    weight: float  # the loss weight: its share of the global batch (0 for the padding forward of an empty share)
    share: float  # its share of this rank's samples: the rank's mean loss is the sum of share * loss


@dataclass(frozen=True)
class StepResult:
    """On the device except `decision` and `updated`."""

    loss: torch.Tensor  # this rank's mean LM loss (what the monitors judge)
    weighted_loss: torch.Tensor  # share-weighted LM loss: its sum over ranks is the global-batch mean
    weighted_aux: torch.Tensor  # the same for the MoE auxiliary loss
    grad_norm: torch.Tensor  # the global gradient norm, before clipping
    decision: Decision  # the agreed decision (Proceed without a check)
    updated: bool  # the optimizer step was applied


def compute_loss(sm: StepModel, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss, weighted MoE aux loss) of one micro-batch, under the configured autocast."""
    if sm.cuda_graphs:
        # A new iteration for CUDA-graph trees: the previous step's graph outputs may be overwritten now.
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(sm.device.type, dtype=sm.compute_dtype, enabled=sm.compute_dtype != torch.float32):
        # The logits then the loss, or the loss fused into an FP8 head (fp8/head.py, tensorwise recipe)
        lm_loss = model_lm_loss(sm.model, inputs, targets, compiled=sm.compiled)
        aux = sm.model.aux_loss()
    return lm_loss, aux


def forward_backward(sm: StepModel, micro_batches: Sequence[MicroBatch],
                     corrupt_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accumulate the gradients of the micro-batches. Returns (rank mean loss, weighted loss, weighted aux)."""
    rank_loss = torch.zeros((), device=sm.device)
    weighted_loss = torch.zeros((), device=sm.device)
    weighted_aux = torch.zeros((), device=sm.device)
    for mb in micro_batches:
        lm_loss, aux = compute_loss(sm, mb.inputs, mb.targets)
        if corrupt_loss is not None:
            lm_loss = corrupt_loss(lm_loss)
        ((lm_loss + aux) * mb.weight).backward()
        rank_loss += lm_loss.detach() * mb.share
        weighted_loss += lm_loss.detach() * mb.weight
        weighted_aux += aux.detach() * mb.weight
    all_reduce_grads_if_unsharded(sm.model, sm.world_size, sm.sharding)
    return rank_loss, weighted_loss, weighted_aux


def grad_norms(sm: StepModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(global grad norm, the norm the monitors see). The global norm is the same on every rank, so a NaN in one
    rank's shard would show everywhere and hide which rank produced it: a rank reports a non-finite norm only if its
    own shard is non-finite."""
    local_norm = local_grad_norm(sm.model, sm.device)
    grad_norm = global_grad_norm(local_norm, sm.world_size, sm.sharding)
    monitored = torch.where(torch.isfinite(local_norm), torch.nan_to_num(grad_norm, nan=0.0, posinf=0.0), local_norm)
    return grad_norm, monitored


def update_router_bias(model: torch.nn.Module, world_size: int, gate: torch.Tensor | None = None) -> None:
    """DeepSeek-V3 aux-loss-free balancing: one bias update per kept step from the expert loads of all ranks."""
    update = getattr(model, "update_load_balance_bias", None)
    if update is None:
        return
    if world_size > 1:
        def all_ranks_sum(counts: torch.Tensor) -> torch.Tensor:
            torch.distributed.all_reduce(counts)
            return counts

        update(all_ranks_sum, gate=gate)
    else:
        update(gate=gate)


def train_step(sm: StepModel, micro_batches: Sequence[MicroBatch], step: int, check: Check | None = None, *,
               corrupt_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
               corrupt_grads: Callable[[torch.nn.Module], None] | None = None) -> StepResult:
    """Optimizer step `step` (see the module docstring). `check` is the divergence guard's (StepGuard.check bound
    to the model and the step); None applies every step. corrupt_loss / corrupt_grads are the fault injector's hooks (tests, demos)."""
    loss, weighted_loss, weighted_aux = forward_backward(sm, micro_batches, corrupt_loss)
    if corrupt_grads is not None:
        corrupt_grads(sm.model)
    grad_norm, monitored_norm = grad_norms(sm)
    router_done = False

    def gated_update(gate: torch.Tensor) -> bool:
        # The router's bias update always (every rank issues its collective at the same point, whatever its optimizer
        # can do), then the clipped optimizer step, which only optim.ChunkedAdamW's kernel can take gated.
        nonlocal router_done
        update_router_bias(sm.model, sm.world_size, gate)
        router_done = True
        return clip_and_step(sm.optimizer, sm.model.parameters(), grad_norm, sm.grad_clip, gate)

    decision, update_applied = (Proceed(step), False) if check is None else check(loss, monitored_norm, gated_update)
    if decision.applies_update:
        if not update_applied:
            clip_and_step(sm.optimizer, sm.model.parameters(), grad_norm, sm.grad_clip)
        if not router_done:
            update_router_bias(sm.model, sm.world_size)
    sm.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, weighted_loss, weighted_aux, grad_norm, decision, decision.applies_update)
