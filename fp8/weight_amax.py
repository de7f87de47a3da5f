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

Kept where the optimizer's tensor is what gets cast: a whole weight (one worker, replicas), whose forward cast reads
it, or under FSDP2's fp8 all-gather (fp8.fsdp_allgather) this rank's shard, whose amax goes into the all-reduce of
the global scale at every all-gather (the forward's and the backward's); that check runs in the all-gather hook.
Not for FSDP2 shards gathered in high precision: their forward casts the gathered weight, whose amax no shard holds.
Which layers keep it, and the hooks, are set up with the optimizer (orchestration.training.optimizer).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8.reference import abs_amax

_TAKEN_AT = "_weight_amax_taken_at"  # (version, address) of the tensor the amax was last reduced from


def fresh_weight_amax(layer: nn.Module, w: torch.Tensor, wrappers: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """layer.weight_amax holding max |w| of `w` as it is now: reduced again only where w changed since (its version
    counter or its address), as no kernel step of the optimizer wrote it; counts reductions in weight_amax_reductions.

    wrappers: tensor subclasses over w (an FSDP2 DTensor parameter, fp8.fsdp_allgather's Fp8AllGatherWeight). An
    in-place op on a wrapper reaches w from inside its __torch_dispatch__, below the dispatch key that advances
    version counters: only the wrapper's counter moves (torch's AdamW on a sharded weight), so theirs count too."""
    now = (w._version, w.data_ptr(), *(t._version for t in wrappers))
    if layer.__dict__.get(_TAKEN_AT) != now:
        with torch.no_grad():
            layer.weight_amax.copy_(abs_amax(w))
        layer.__dict__[_TAKEN_AT] = now
        layer.weight_amax_reductions += 1
    return layer.weight_amax


def start_keeping(layer: nn.Module, kind: str) -> None:
    """Mark `layer` as keeping its weight amax ("weight": the whole weight, the forward's cast reads it; "shard": its
    FSDP2 fp8 all-gather shard), to be reduced at its next use."""
    if kind not in ("weight", "shard"):
        raise ValueError(f"kind must be 'weight' or 'shard', got {kind!r}")
    layer.weight_amax_of = kind
    layer.weight_amax_reductions = 0
    layer.__dict__.pop(_TAKEN_AT, None)
