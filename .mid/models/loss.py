"""Language-model loss: mean token cross-entropy in fp32 from (usually bf16) logits.

The eager form materializes fp32 copies of the [tokens, vocab] logits four times over (upcast, log-softmax, its
gradient, the downcast of the gradient): tens of GB of memory traffic per step for DeepSeek-MoE's 102400-token vocab
at 16384 tokens, and softmax kernels a visible share of the step's profile (BENCHMARKS.md). Compiled, Inductor fuses
the upcast into the reductions and writes the bf16 gradient directly, with the same fp32 arithmetic.
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


def head_fuses_loss(head: torch.nn.Module | None) -> bool:
    """Whether `head` computes the loss itself now (fp8.head.Float8LMHead.fuses_loss; False for any other head)."""
    fuses = getattr(head, "fuses_loss", None)
    return fuses is not None and fuses()


def head_output(head: torch.nn.Module, h_BTD: torch.Tensor, targets_BT: torch.Tensor | None) -> torch.Tensor:
    """A language model's forward tail: the logits [B, T, V] without targets; with them the mean token cross-entropy,
    fused into an FP8 head that can (fp8.head.Float8LMHead.fuses_loss), else of the logits (eager loss;
    model_lm_loss picks the compiled one)."""
    if targets_BT is None:
        return head(h_BTD)
    if head_fuses_loss(head):
        return head(h_BTD, targets=targets_BT)
    return token_cross_entropy(head(h_BTD), targets_BT)


def model_lm_loss(model: torch.nn.Module, tokens_BT: torch.Tensor, targets_BT: torch.Tensor,
                  compiled: bool) -> torch.Tensor:
    """The model's mean token cross-entropy on (tokens, targets).

    Where the output head is an FP8 head that fuses the loss (fp8.head.Float8LMHead.fuses_loss: FP8 on, tensorwise,
    fused_loss on), the model's forward with targets has the head compute the loss from the final hidden states, so
    the logits' gradient is written once, in fp8, instead of as a bf16 tensor the head casts again (fp8/head.py).
    Otherwise: the logits, then lm_loss. Both compute the same function; the head falls back to the second form
    with set_precision("bf16").
    """
    if head_fuses_loss(getattr(model, "output", None)):
        return model(tokens_BT, targets_BT)
    return lm_loss(model(tokens_BT), targets_BT, compiled)
