"""Llama 3 dense transformer: RMSNorm, RoPE with Llama 3 frequency scaling, GQA attention, SwiGLU.

Read top to bottom: hyper-parameters, small modules, the transformer block, the whole model.
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

from models.init import init_model_by_units
from models.loss import head_output


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


def rope_cos_sin(freqs_P: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [T, P] in fp32 (angles computed in fp64: position * freq loses digits in fp32)."""
    pos_T = torch.arange(max_seq_len, dtype=torch.float64, device=freqs_P.device)
    angle_TP = torch.outer(pos_T, freqs_P)
    return angle_TP.cos().float(), angle_TP.sin().float()


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the activation dtype (bf16 mean-square loses too much).
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


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


def depth_init_std(layer_id: int, base_std: float = 0.02) -> float:
    # Output projections shrink with depth so the residual stream's variance stays bounded (torchtitan depth_init).
    return base_std / math.sqrt(2 * (layer_id + 1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.kv_heads)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x_BTD: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_TP, sin_TP)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))

    def init_weights(self) -> None:
        out_std = depth_init_std(self.layer_id)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(0.02, out_std)
        self.feed_forward.init_weights(0.02, out_std)


class Llama3(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # RoPE tables: non-persistent (recomputed, never checkpointed), fp32 even when params are bf16.
        cos_TP, sin_TP = self._rope_tables(device=None)
        self.register_buffer("rope_cos", cos_TP, persistent=False)
        self.register_buffer("rope_sin", sin_TP, persistent=False)
        self.tie_weights()

    def _rope_tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        freqs_P = rope_frequencies(
            a.head_dim, a.rope_theta, a.rope_scaling_factor, a.rope_low_freq_factor,
            a.rope_high_freq_factor, a.rope_original_max_seq_len, device=device,
        )
        return rope_cos_sin(freqs_P, a.max_seq_len)

    def tie_weights(self) -> None:
        # to_empty() from meta gives each module a fresh Parameter and so unties; call again after it.
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Llama3:
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def hidden_states(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states the output head reads (models.loss.model_lm_loss fuses head and loss)."""
        T = tokens_BT.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.args.max_seq_len}; raise max_seq_len")
        h_BTD = self.tok_embeddings(tokens_BT)
        for layer in self.layers.values():
            h_BTD = layer(h_BTD, self.rope_cos, self.rope_sin)
        return self.norm(h_BTD)

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V]; with targets, the mean token cross-entropy (models.loss.head_output). Through forward,
        not hidden_states plus the head, so that wrappers' hooks (FSDP2's root unshard) run."""
        return head_output(self.output, self.hidden_states(tokens_BT), targets_BT)

    def aux_loss(self) -> torch.Tensor:
        return torch.zeros((), device=self.norm.weight.device)

    def update_load_balance_bias(self, reduce_fn=None, gate=None) -> None:
        """Dense model: nothing to balance."""

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init (same seed, same weights) after to_empty(); also recomputes the RoPE tables. Each unit
        (the root's own weights, each block) draws from its own seed (models.init), so the unit-by-unit sharded
        initialisation of large models gives these same weights."""
        init_model_by_units(self, seed)

    @torch.no_grad()
    def init_root_weights(self) -> None:
        """The weights outside the blocks (embedding, output head, final norm) and the RoPE tables."""
        device = self.rope_cos.device
        if device.type != "meta":
            cos_TP, sin_TP = self._rope_tables(device=device)
            self.rope_cos.copy_(cos_TP)
            self.rope_sin.copy_(sin_TP)
        out_std = self.args.dim**-0.5
        if self.args.tie_embeddings:
            # One matrix serves as embedding and output: give it the output scale (logits of order 1).
            nn.init.trunc_normal_(self.tok_embeddings.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        else:
            nn.init.normal_(self.tok_embeddings.weight)
            nn.init.trunc_normal_(self.output.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        self.norm.reset_parameters()
