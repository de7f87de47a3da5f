"""Numeric helpers shared by the FP8 tests."""

import torch


def sqnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of x against ref in dB (float64; inf when they are equal)."""
    ref = ref.detach().double()
    return float(20 * torch.log10(ref.norm() / (x.detach().double() - ref).norm()))
