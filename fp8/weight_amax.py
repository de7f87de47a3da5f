"""The tensorwise FP8 layers' weight amax, kept from one weight change to the next instead of reduced at every forward.

A tensorwise cast needs max |w| before it can cast w: a pass reading the whole weight (4 bytes an element for float32
master weights) before the pass that casts it. The weight changes once a step, in the optimizer, which reads and
writes every element anyway: optim.ChunkedAdamW.keep_weight_amax has its kernel write each weight's amax from the
values it stores, and the forward's cast reads the weight once (Float8Linear.kept_weight_amax).

Correctness rests on one rule: the amax a forward uses is max |w| of the weight as it is then. The optimizer's kernel
writes it with the weight. Every other change of a weight (a checkpoint load, a rollback, an import of Hugging Face
weights, torch's AdamW where the kernel does not step, an initialisation) goes through torch's in-place ops, which
advance the weight's version counter; a forward pre-hook on the model compares each kept weight's version and address
with those its amax was taken at and reduces again where they differ, before any layer runs. The kernel writes through
raw addresses and leaves the counter alone, so after its step nothing is reduced again.

Kept only for weights that are the optimizer's own tensors (one worker, or replicas): under FSDP2 a forward's weight
is the gathered tensor, whose amax no single shard's optimizer step knows (the fp8 all-gather reduces its own).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8.linear import Float8Linear
from fp8.reference import abs_amax


def _is_plain(p: torch.Tensor) -> bool:
    """A parameter with storage of its own (not an FSDP2 DTensor shard or an fp8 all-gather wrapper)."""
    return type(p) in (torch.Tensor, nn.Parameter)


def _identity(w: torch.Tensor) -> tuple[int, int]:
    return w._version, w.data_ptr()


class WeightAmaxKeeper:
    """The kept weight amax of a model's tensorwise FP8 layers (see the module docstring); `refresh_stale()` runs
    before every forward of the model (its pre-hook)."""

    def __init__(self, layers: list[Float8Linear]):
        self.layers = layers
        self._taken_at: list[tuple[int, int] | None] = [None] * len(layers)
        self.reductions = 0  # weights reduced again by refresh_stale (tests read it)

    def refresh_stale(self) -> None:
        """Reduce max |w| again for each kept weight changed since its amax was taken (or never taken)."""
        stale = [i for i, layer in enumerate(self.layers) if self._taken_at[i] != _identity(layer.weight)]
        if not stale:
            return
        with torch.no_grad():
            for i in stale:
                layer = self.layers[i]
                layer.weight_amax.copy_(abs_amax(layer.weight))
                self._taken_at[i] = _identity(layer.weight)
        self.reductions += len(stale)


def keep_weight_amax(model: nn.Module, optimizer: torch.optim.Optimizer) -> WeightAmaxKeeper | None:
    """Keep the weight amax of `model`'s tensorwise FP8 layers whose weights are plain tensors the optimizer steps:
    their forwards read it, `optimizer` writes it where it is an optim.ChunkedAdamW, and a pre-hook on `model` reduces
    it again after any other change. None when no layer qualifies (bf16, rowwise recipes, FSDP2 shards)."""
    from optim import ChunkedAdamW

    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    layers = [m for m in model.modules() if isinstance(m, Float8Linear) and m.recipe.granularity == "tensorwise"
              and _is_plain(m.weight) and id(m.weight) in stepped and m.weight_amax.dtype == torch.float32]
    if not layers:
        return None
    keeper = WeightAmaxKeeper(layers)
    for layer in layers:
        layer.weight_amax_kept = True
    if isinstance(optimizer, ChunkedAdamW):
        optimizer.keep_weight_amax(layers)
    model.register_forward_pre_hook(lambda _module, _args: keeper.refresh_stale())
    return keeper
