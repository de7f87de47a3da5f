"""The training step: forward and backward over this rank's micro-batches, the gradient norm, the divergence check and
the update it allows. The worker loop (loop.py) runs `train_step` once per optimizer step and
benchmarks/train_step.py times the same function, so the headline benchmark measures the product's step.

What the step does not do is the bookkeeping around it (data cursor, LR schedule, logging, checkpoints) and the
decision's consequences beyond the update (events, precision switches, rollback): the loop owns those. Nor does it
know of fault injection: faults attach from outside (training/faults.py), to the model's modules as forward hooks
and to the StepModel's loss and gradient hooks.

Order inside a step, and why:
1. forward_backward: every micro-batch's loss scaled by its share of the global batch, so the sum of the gradients
   over ranks is the global-batch mean whatever the split (elastic world sizes give uneven ones).
2. grad_norms: one pass over the gradients for the rank's own norm and, from it, the global norm (clip_grad_norm_
   would read them all a second time).
3. the divergence check (the guard): the FP8 health this step's forwards left, the shadow losses when due, then
   ONE collective and ONE host read; the GatedUpdate lets the guard launch the clipped update on the device before
   that read, gated by the verdict, so the GPU runs the optimizer while the host decides.
4. the update, if the decision applies it and the gated launch did not: the clip scales after the decision, so a
   skipped step never scales the gradients it drops. optim.ChunkedAdamW (train.adamw) scales inside its one launch;
   with torch's AdamW the scaling pass at least keeps the GPU busy while the host runs AdamW's Python prologue (the
   GPU otherwise waited there in the MoE host profile).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from models.loss import model_lm_loss
from optim import clip_and_step
from orchestration.divergence.agreement import StopRequest
from orchestration.divergence.guard import StepGuard
from orchestration.divergence.policy import Decision, Proceed
from orchestration.training.distributed import all_reduce_grads_if_unsharded, global_grad_norm, local_grad_norm


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
    # Attached from outside, as forward hooks are to modules (training/faults.py): each loss hook maps a micro-batch's
    # LM loss before its backward; each grad hook sees the model once the gradients are reduced, before their norm.
    loss_hooks: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    grad_hooks: list[Callable[[torch.nn.Module], object]] = field(default_factory=list)


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


def forward_backward(sm: StepModel, micro_batches: Sequence[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """Accumulate the gradients of the micro-batches. Returns (rank mean loss, weighted loss, weighted aux)."""
    rank_loss = torch.zeros((), device=sm.device)
    weighted_loss = torch.zeros((), device=sm.device)
    weighted_aux = torch.zeros((), device=sm.device)
    for mb in micro_batches:
        lm_loss, aux = compute_loss(sm, mb.inputs, mb.targets)
        for hook in sm.loss_hooks:
            lm_loss = hook(lm_loss)
        ((lm_loss + aux) * mb.weight).backward()
        rank_loss += lm_loss.detach() * mb.share
        weighted_loss += lm_loss.detach() * mb.weight
        weighted_aux += aux.detach() * mb.weight
    all_reduce_grads_if_unsharded(sm.model, sm.world_size, sm.sharding)
    for hook in sm.grad_hooks:
        hook(sm.model)
    return rank_loss, weighted_loss, weighted_aux


def grad_norms(sm: StepModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(global grad norm, the norm the monitors see). The global norm is the same on every rank, so a NaN in one
    rank's shard would show everywhere and hide which rank produced it: a rank reports a non-finite norm only if its
    own shard is non-finite."""
    local_norm = local_grad_norm(sm.model, sm.device)
    grad_norm = global_grad_norm(local_norm, sm.world_size, sm.sharding)
    monitored = torch.where(torch.isfinite(local_norm), torch.nan_to_num(grad_norm, nan=0.0, posinf=0.0), local_norm)
    return grad_norm, monitored


@contextlib.contextmanager
def computing_in_bf16(model: torch.nn.Module, precision: str, bf16_layers: tuple[str, ...] | None) -> Iterator[None]:
    """The whole model in BF16 for a comparison with FP8 (the shadow check, the eval gap), then back in the precision
    in force: `precision`, and BF16 for the layers a layer-scoped fallback holds there."""
    import fp8

    fp8.set_precision(model, "bf16")
    try:
        yield
    finally:
        fp8.set_precision(model, precision)
        if bf16_layers:
            fp8.set_precision(model, "bf16", scope=list(bf16_layers))


def shadow_losses(sm: StepModel, mb: MicroBatch, guard: StepGuard) -> tuple[torch.Tensor, torch.Tensor]:
    """The guard's shadow check: `mb` recomputed (no grad) in FP8 as the run trains now (layers the policy holds in
    bf16 stay there) and in all-bf16."""
    with torch.no_grad():
        loss_fp8 = compute_loss(sm, mb.inputs, mb.targets)[0]
        with computing_in_bf16(sm.model, *guard.precision_in_force()):
            loss_bf16 = compute_loss(sm, mb.inputs, mb.targets)[0]
    return loss_fp8, loss_bf16


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


class GatedUpdate:
    """The step's update: the router's bias update, then the clipped optimizer step. The guard may launch it before
    its host read, gated on the device by the verdict (`launch`); `finish` does what that launch did not, once the
    decision applies the update."""

    def __init__(self, sm: StepModel, grad_norm: torch.Tensor):
        self.sm, self.grad_norm = sm, grad_norm
        self.router_updated = False

    def launch(self, gate: torch.Tensor) -> bool:
        """The router's bias update always (every rank issues its collective at the same point, whatever its
        optimizer can do), then the optimizer step, which only optim.ChunkedAdamW's kernel can take gated: whether
        it did."""
        update_router_bias(self.sm.model, self.sm.world_size, gate)
        self.router_updated = True
        return clip_and_step(self.sm.optimizer, self.sm.model.parameters(), self.grad_norm, self.sm.grad_clip, gate)

    def finish(self, optimizer_stepped: bool) -> None:
        if not optimizer_stepped:
            clip_and_step(self.sm.optimizer, self.sm.model.parameters(), self.grad_norm, self.sm.grad_clip)
        if not self.router_updated:
            update_router_bias(self.sm.model, self.sm.world_size)


def train_step(sm: StepModel, micro_batches: Sequence[MicroBatch], step: int, guard: StepGuard | None = None,
               stop: StopRequest | None = None) -> StepResult:
    """Optimizer step `step` (see the module docstring). Without a guard every step applies. stop: a save-and-stop
    request the guard agrees on in its collective (divergence/agreement.py)."""
    loss, weighted_loss, weighted_aux = forward_backward(sm, micro_batches)
    grad_norm, monitored_norm = grad_norms(sm)
    update = GatedUpdate(sm, grad_norm)
    decision, update_applied = Proceed(step), False
    if guard is not None:
        fp8_health = guard.read_fp8_health(sm.model)  # before the shadow forwards overwrite this step's statistics
        shadow = shadow_losses(sm, micro_batches[0], guard) if guard.shadow_due(step) else None
        decision, update_applied = guard.check(step, loss, monitored_norm, fp8_health, shadow, update.launch, stop)
    if decision.applies_update:
        update.finish(optimizer_stepped=update_applied)
    sm.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, weighted_loss, weighted_aux, grad_norm, decision, decision.applies_update)
