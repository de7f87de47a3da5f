"""Llama 3 dense transformer: RoPE with Llama 3 frequency scaling, GQA attention, SwiGLU.

Read top to bottom: hyper-parameters, RoPE, attention and feed-forward, the transformer block, the model. The
decoder around the blocks (embedding, final RMSNorm, output head, RoPE tables, init) is models/decoder.py's.
Built on the meta device and initialised on the target device (`to_empty` then `init_weights`); no distributed
code here: FSDP is applied from outside per entry of `model.layers`.

RoPE uses Meta's interleaved-pair convention (as the original checkpoints and torchtitan); Hugging Face checkpoints
store wq/wk with rows permuted to its rotate-half convention (see tests/test_models_llama.py for the mapping).

Shape legend (suffixes of tensor names):
  B batch, T sequence position, D model dim, H query heads, G key/value heads, C head dim,
  P rotary pairs per head (C // 2), F feed-forward hidden dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import Decoder, DecoderBlock


@dataclass
class Llama3Args:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = 8  # None: plain multi-head attention
    vocab_size: int = 128256
    # SwiGLU width: 2/3 * 4 * dim, times ffn_dim_multiplier, rounded up to multiple_of (Meta's rule);
    # ffn_hidden_dim, when set, wins over the rule.
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    ffn_hidden_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 frequency scaling; rope_scaling_factor None turns it off.
    rope_scaling_factor: float | None = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier, self.ffn_hidden_dim)

    def validate(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head dim {self.head_dim} must be even for RoPE; change dim or n_heads")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}")
        for name in ("dim", "n_layers", "vocab_size", "max_seq_len", "multiple_of"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def ffn_hidden_dim(dim: int, multiple_of: int, multiplier: float | None, explicit: int | None) -> int:
    if explicit is not None:
        return explicit
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# ---------------------------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequencies [P] in fp64, with Llama 3.1 scaling: long wavelengths are divided by the factor,
    short ones kept, the band between interpolated smoothly (llama-models `apply_scaling`)."""
    freqs_P = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    if scaling_factor is None:
        return freqs_P
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen_P = 2 * math.pi / freqs_P
    smooth_P = (original_max_seq_len / wavelen_P - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_P = (1 - smooth_P) * freqs_P / scaling_factor + smooth_P * freqs_P
    out_P = torch.where(wavelen_P > low_freq_wavelen, freqs_P / scaling_factor, smoothed_P)
    return torch.where(wavelen_P < high_freq_wavelen, freqs_P, out_P)


def apply_rope(x_BTHC: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2p], x[2p+1]) by angle pos * freq[p], in fp32."""
    B, T, H, C = x_BTHC.shape
    x_BTHP2 = x_BTHC.float().reshape(B, T, H, C // 2, 2)
    x0, x1 = x_BTHP2[..., 0], x_BTHP2[..., 1]
    cos = cos_TP[:T, None, :]
    sin = sin_TP[:T, None, :]
    out_BTHP2 = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out_BTHP2.reshape(B, T, H, C).type_as(x_BTHC)


# ---------------------------------------------------------------------------------------------------------------
# Modules


class Attention(nn.Module):
    """Causal grouped-query attention through scaled_dot_product_attention."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x_BTD: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTHC = apply_rope(self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim), cos_TP, sin_TP)
        k_BTGC = apply_rope(self.wk(x_BTD).view(B, T, self.n_kv_heads, self.head_dim), cos_TP, sin_TP)
        v_BTGC = self.wv(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        # Repeat kv heads explicitly (not enable_gqa) so every SDPA backend, flash included, accepts the inputs.
        rep = self.n_heads // self.n_kv_heads
        k_BTHC = k_BTGC.repeat_interleave(rep, dim=2) if rep > 1 else k_BTGC
        v_BTHC = v_BTGC.repeat_interleave(rep, dim=2) if rep > 1 else v_BTGC
        o_BHTC = F.scaled_dot_product_attention(
            q_BTHC.transpose(1, 2), k_BTHC.transpose(1, 2), v_BTHC.transpose(1, 2), is_causal=True
        )
        return self.wo(o_BHTC.transpose(1, 2).reshape(B, T, -1))

    def init_weights(self, init_std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_std)


class TransformerBlock(DecoderBlock):
    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__(layer_id, args.dim, args.norm_eps, Attention(args.dim, args.n_heads, args.kv_heads))
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    @property
    def ffn(self) -> FeedForward:
        return self.feed_forward


class Llama3(Decoder):
    def __init__(self, args: Llama3Args):
        super().__init__(args, lambda layer_id: TransformerBlock(layer_id, args))

    def rotary_frequencies(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return rope_frequencies(
            a.head_dim, a.rope_theta, a.rope_scaling_factor, a.rope_low_freq_factor,
            a.rope_high_freq_factor, a.rope_original_max_seq_len, device=device,
        )
