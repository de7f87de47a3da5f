"""Numeric helpers shared by the FP8 tests."""

import torch


def sqnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of x against ref in dB (float64; inf when they are equal)."""
    ref = ref.detach().double()
    return float(20 * torch.log10(ref.norm() / (x.detach().double() - ref).norm()))


def lm_head_case(device: str, seed: int = 0, tokens: int = 512, dim: int = 256, vocab: int = 16384):
    """An LM output head with a large vocabulary and peaked logits (std ~4, as a trained model's), Zipf-distributed
    targets: (bf16 nn.Linear head, bf16 inputs, targets). The case where an FP8 head could hurt: its gradient is
    softmax - onehot, mostly tiny values next to a few large ones, cast to e5m2."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=g) * dim**-0.5)
    x = (4 * torch.randn(tokens, dim, generator=g)).to(torch.bfloat16)
    zipf = 1 / torch.arange(1, vocab + 1, dtype=torch.float64)
    targets = torch.multinomial(zipf / zipf.sum(), tokens, replacement=True, generator=g)
    return head.to(device, torch.bfloat16), x.to(device), targets.to(device)


def head_loss_and_grads(head: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor, dtype=None):
    """Cross-entropy of head(x) in fp32 -> (loss, logits, grad of x, grad of the weight), all detached."""
    import torch.nn.functional as F

    x = x.detach().clone().to(dtype or x.dtype).requires_grad_(True)
    head.weight.grad = None
    logits = head(x)
    loss = F.cross_entropy(logits.float(), targets)
    loss.backward()
    return loss.detach(), logits.detach(), x.grad.detach().clone(), head.weight.grad.detach().clone()
