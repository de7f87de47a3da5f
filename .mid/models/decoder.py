"""The decoder-only transformer every model family here shares: token embedding, a stack of pre-norm residual
blocks, the final RMSNorm, the output head, the RoPE tables and their initialisation.

A family (models/llama3.py, models/deepseek_moe.py) supplies its block (a `DecoderBlock` with its own attention and
feed-forward) and its rotary frequencies; everything above the blocks is written once, here. Parameter names are
the families' checkpoint names: `tok_embeddings`, `layers.<i>.{attention_norm, attention, ffn_norm, <ffn>}`, `norm`,
`output`. No distributed code: FSDP is applied from outside per entry of `model.layers`.

Shape legend (suffixes of tensor names): B batch, T sequence position, D model dim, P rotary pairs, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from models.init import init_model_by_units
from models.loss import head_output


class DecoderArgs(Protocol):
    """The hyper-parameters the decoder reads; each family's args dataclass has them."""

    dim: int
    n_layers: int
    vocab_size: int
    norm_eps: float
    max_seq_len: int
    tie_embeddings: bool

    def validate(self) -> None: ...


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


def rope_cos_sin(freqs_P: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [T, P] in fp32 (angles computed in fp64: position * freq loses digits in fp32)."""
    pos_T = torch.arange(max_seq_len, dtype=torch.float64, device=freqs_P.device)
    angle_TP = torch.outer(pos_T, freqs_P)
    return angle_TP.cos().float(), angle_TP.sin().float()


def depth_init_std(layer_id: int, base_std: float = 0.02) -> float:
    # Output projections shrink with depth so the residual stream's variance stays bounded (torchtitan depth_init).
    return base_std / math.sqrt(2 * (layer_id + 1))


class DecoderBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(norm(x)), out = h + ffn(norm(h)).

    The family's block passes its attention module (called as attention(x, cos_TP, sin_TP)) and then registers its
    feed-forward under the family's parameter name, returning it from `ffn`.
    """

    def __init__(self, layer_id: int, dim: int, norm_eps: float, attention: nn.Module):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)

    @property
    def ffn(self) -> nn.Module:
        raise NotImplementedError

    def forward(self, x_BTD: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_TP, sin_TP)
        return h_BTD + self.ffn(self.ffn_norm(h_BTD))

    def init_weights(self) -> None:
        out_std = depth_init_std(self.layer_id)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(0.02, out_std)
        self.ffn.init_weights(0.02, out_std)


class Decoder(nn.Module):
    """Embedding, `args.n_layers` blocks from `make_block(layer_id)`, final norm, output head, RoPE tables.

    A family subclasses it and implements `rotary_frequencies`; a family with auxiliary losses or per-step state
    (MoE load balance) overrides `aux_loss` and `update_load_balance_bias`.
    """

    def __init__(self, args: DecoderArgs, make_block: Callable[[int], DecoderBlock]):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): make_block(i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # RoPE tables: non-persistent (recomputed, never checkpointed), fp32 even when params are bf16.
        cos_TP, sin_TP = self.rope_tables(device=None)
        self.register_buffer("rope_cos", cos_TP, persistent=False)
        self.register_buffer("rope_sin", sin_TP, persistent=False)
        self.tie_weights()

    def rotary_frequencies(self, device: torch.device | None) -> torch.Tensor:
        """Inverse frequencies [P] in fp64 of the family's RoPE."""
        raise NotImplementedError

    def rope_tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.rotary_frequencies(device), self.args.max_seq_len)

    def tie_weights(self) -> None:
        # to_empty() from meta gives each module a fresh Parameter and so unties; call again after it.
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Decoder:
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
        """Auxiliary loss of the last forward, added to the LM loss; none in a plain decoder."""
        return torch.zeros((), device=self.norm.weight.device)

    def update_load_balance_bias(self, reduce_fn=None, gate=None) -> None:
        """Per-step balancing state after the optimizer step; nothing to balance in a plain decoder."""

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
            cos_TP, sin_TP = self.rope_tables(device=device)
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
