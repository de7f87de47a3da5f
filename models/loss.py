"""Language-model loss: mean token cross-entropy in fp32 from (usually bf16) logits.

The eager form materializes fp32 copies of the [tokens, vocab] logits four times over (upcast, log-softmax, its
gradient, the downcast of the gradient): ~60 GB of memory traffic per step for DeepSeek-MoE's 102400-token vocab at
16384 tokens, 13 ms of softmax kernels alone in an H200 profile (BENCHMARKS.md). Compiled, Inductor fuses the upcast
into the reductions and writes the bf16 gradient directly, with the same fp32 arithmetic.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def token_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all B*S tokens, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


@functools.cache
def _compiled_token_cross_entropy():
    # Static shapes: a training run has one micro-batch shape, and a static kernel needs no size checks.
    return torch.compile(token_cross_entropy, dynamic=False)


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, compiled: bool) -> torch.Tensor:
    """token_cross_entropy, through torch.compile when `compiled` (the model's blocks are compiled on GPUs)."""
    fn = _compiled_token_cross_entropy() if compiled else token_cross_entropy
    return fn(logits_BSV, targets_BS)
