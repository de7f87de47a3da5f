"""DeepSeek-MoE: fine-grained routed experts plus always-on shared experts, first layers dense.

Read top to bottom: hyper-parameters, routing numerics (pure functions), token permutation, the grouped experts,
the MoE layer, multi-head latent attention (DeepSeek-V2/V3 shape), the block, the model (models/decoder.py's
decoder around the blocks, plus the load-balance state).
No distributed code; expert parallelism and FSDP are applied from outside.

Routing (DeepSeekMoE, arXiv 2401.06066; DeepSeek-V3, arXiv 2412.19437):
  scores = softmax (or sigmoid) of gate logits, computed in fp32; experts chosen by top-k of scores (+ the
  auxiliary-loss-free bias when enabled: it moves the choice, never the mixing weight); mixing weight = score of
  the chosen expert (optionally renormalised over the k chosen).
Load balance: the auxiliary loss alpha * sum_e f_e * P_e (per sequence or per batch), and/or the V3 bias update
  b_e += speed * sign(mean_count - count_e) applied by `update_load_balance_bias()` after the optimizer step.
Expert compute: tokens sorted by expert, three grouped GEMMs (torch._grouped_mm), un-sorted by a gather.
The per-expert loop (`routed_experts_reference`, `grouped_mm_reference`) is kept only as the test reference.

Shape legend (suffixes of tensor names):
  B batch, T sequence position, S tokens (B*T), D model dim, E routed experts, A experts per token (top-k),
  R routed rows (S*A), I expert hidden dim, J = 2I (gate and up projections side by
  side), H heads, C head dim, P rotary pairs, V vocabulary; in the grouped GEMM helpers M rows, K inner dim,
  N output dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import Decoder, DecoderBlock, RMSNorm
from models.llama3 import Attention, FeedForward, apply_rope, rope_frequencies

SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_SCOPES = ("seq", "batch")
ATTENTION_KINDS = ("mha", "mla")


@dataclass
class DeepSeekMoEArgs:
    dim: int = 2048
    n_layers: int = 28
    n_heads: int = 16
    vocab_size: int = 102400
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    # Dense layers (the first n_dense_layers) use a SwiGLU of width inter_dim.
    n_dense_layers: int = 1
    inter_dim: int = 10944
    # MoE layers: n_routed_experts of width moe_inter_dim, top n_activated_experts, plus one shared SwiGLU of
    # width n_shared_experts * moe_inter_dim (the shared experts fused, as DeepSeek does).
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_activated_experts: int = 6
    moe_inter_dim: int = 1408
    score_func: str = "softmax"
    route_norm: bool = False  # renormalise the top-k weights to sum 1 (V3: True; DeepSeekMoE-16B: False)
    route_scale: float = 1.0
    n_expert_groups: int = 1  # V3 group-limited routing: choose n_limited_groups groups, then top-k inside
    n_limited_groups: int = 1
    # None: dropless. Otherwise each expert keeps at most ceil(capacity_factor * S * A / E) assignments per
    # forward, earlier tokens first; the dropped assignments get weight 0 (the token keeps its other experts).
    capacity_factor: float | None = None
    aux_loss_alpha: float = 0.001  # 0 turns the auxiliary loss off
    aux_loss_scope: str = "seq"  # "seq": per-sequence f and P (V3's complementary loss); "batch": over all tokens
    aux_free_bias: bool = False  # DeepSeek-V3 auxiliary-loss-free balancing
    bias_update_speed: float = 0.001
    # Attention: "mha" (DeepSeekMoE-16B, Llama-style) or "mla" (multi-head latent attention, V2/V3).
    attention: str = "mha"
    q_lora_rank: int = 0  # MLA: 0 means a plain wq
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    @property
    def rope_head_dim(self) -> int:
        return self.dim // self.n_heads if self.attention == "mha" else self.qk_rope_head_dim

    def validate(self) -> None:
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r}; choose one of {SCORE_FUNCS}")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"aux_loss_scope={self.aux_loss_scope!r}; choose one of {AUX_LOSS_SCOPES}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.attention!r}; choose one of {ATTENTION_KINDS}")
        if not 1 <= self.n_activated_experts <= self.n_routed_experts:
            raise ValueError(
                f"n_activated_experts={self.n_activated_experts} must be in [1, n_routed_experts="
                f"{self.n_routed_experts}]"
            )
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be in [0, n_layers={self.n_layers}]")
        if self.n_routed_experts % self.n_expert_groups != 0 or self.n_limited_groups > self.n_expert_groups:
            raise ValueError(
                f"n_routed_experts={self.n_routed_experts} must split into n_expert_groups={self.n_expert_groups}"
                f" groups and n_limited_groups={self.n_limited_groups} <= n_expert_groups"
            )
        if self.n_limited_groups * (self.n_routed_experts // self.n_expert_groups) < self.n_activated_experts:
            raise ValueError("n_limited_groups groups hold fewer experts than n_activated_experts; raise it")
        # torch._grouped_mm wants every row 16-byte aligned: 8 elements in bf16 (4 in fp32).
        if self.dim % 8 or self.moe_inter_dim % 8:
            raise ValueError(
                f"dim={self.dim} and moe_inter_dim={self.moe_inter_dim} must be multiples of 8 for grouped GEMM"
            )
        if self.attention == "mha" and (self.dim % self.n_heads or (self.dim // self.n_heads) % 2):
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads of even size")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None (dropless), got {self.capacity_factor}")


# ---------------------------------------------------------------------------------------------------------------
# Routing numerics (pure functions)


def route(
    logits_SE: torch.Tensor,
    top_k: int,
    score_func: str = "softmax",
    bias_E: torch.Tensor | None = None,
    route_norm: bool = False,
    route_scale: float = 1.0,
    n_groups: int = 1,
    n_limited_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (scores_SE fp32, expert_SA int64, weight_SA fp32)."""
    logits_SE = logits_SE.float()
    scores_SE = logits_SE.softmax(-1) if score_func == "softmax" else logits_SE.sigmoid()
    select_SE = scores_SE if bias_E is None else scores_SE + bias_E.float()
    if n_groups > 1:
        S, E = select_SE.shape
        select_SGe = select_SE.view(S, n_groups, E // n_groups)
        # V3 ranks a group by the sum of its two best (biased) scores.
        group_score_SG = select_SGe.topk(min(2, E // n_groups), dim=-1).values.sum(-1)
        keep_SG = torch.zeros_like(group_score_SG, dtype=torch.bool)
        keep_SG.scatter_(1, group_score_SG.topk(n_limited_groups, dim=-1).indices, True)
        select_SE = select_SGe.masked_fill(~keep_SG[..., None], float("-inf")).view(S, E)
    expert_SA = select_SE.topk(top_k, dim=-1).indices
    weight_SA = scores_SE.gather(1, expert_SA)
    if route_norm:
        weight_SA = weight_SA / (weight_SA.sum(-1, keepdim=True) + 1e-20)
    return scores_SE, expert_SA, weight_SA * route_scale


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def apply_capacity(expert_SA: torch.Tensor, weight_SA: torch.Tensor, n_experts: int, capacity: int):
    """Zero the weight of assignments beyond `capacity` per expert, earlier (token, slot) first.
    Returns (weight_SA, kept_SA bool)."""
    onehot_RE = F.one_hot(expert_SA.reshape(-1), n_experts)
    rank_R = (onehot_RE.cumsum(0) * onehot_RE).sum(-1) - 1  # position of the assignment in its expert's queue
    kept_SA = (rank_R < capacity).view_as(expert_SA)
    return weight_SA * kept_SA, kept_SA


def expert_counts(expert_SA: torch.Tensor, n_experts: int, kept_SA: torch.Tensor | None = None) -> torch.Tensor:
    """Assignments per expert [E] fp32 (scatter_add, not bincount: bincount has no meta kernel)."""
    ones = torch.ones(expert_SA.numel(), device=expert_SA.device)
    if kept_SA is not None:
        ones = ones * kept_SA.reshape(-1)
    return torch.zeros(n_experts, device=expert_SA.device).scatter_add_(0, expert_SA.reshape(-1), ones)


def load_balance_loss(scores_BTE: torch.Tensor, expert_BTA: torch.Tensor, scope: str = "seq") -> torch.Tensor:
    """sum_e f_e * P_e with f_e = E / (A * T) * (assignments to e), P_e = mean over tokens of the normalised
    score of e; per sequence then averaged ("seq") or over all B*T tokens ("batch"). Equals 1 when balanced.
    Unweighted: the caller multiplies by alpha."""
    B, T, E = scores_BTE.shape
    A = expert_BTA.shape[-1]
    probs_BTE = scores_BTE / scores_BTE.sum(-1, keepdim=True)  # identity for softmax; normalises sigmoid
    counts_BE = torch.zeros(B, E, device=scores_BTE.device).scatter_add_(
        1, expert_BTA.reshape(B, T * A), torch.ones(B, T * A, device=scores_BTE.device)
    )
    if scope == "seq":
        f_BE = counts_BE * (E / (A * T))
        return (f_BE * probs_BTE.mean(1)).sum(-1).mean()
    f_E = counts_BE.sum(0) * (E / (A * T * B))
    return (f_E * probs_BTE.mean((0, 1))).sum()


# ---------------------------------------------------------------------------------------------------------------
# Token permutation: sort assignments by expert so each expert's rows are contiguous for the grouped GEMM.


def permute_by_expert(expert_SA: torch.Tensor, n_experts: int):
    """Returns (token_R, slot_R, offs_E): assignment r (in expert order, row r of the grouped GEMM input) comes from
    token token_R[r], slot slot_R[r]; offs_E: int32 cumulative group ends, torch._grouped_mm semantics. Groups follow
    each other with no padding rows (no grouped GEMM here contracts over the token dim in fp8, the one that would need
    16-row aligned groups). No host sync.
    """
    A = expert_SA.shape[1]
    flat_R = expert_SA.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)  # stable: earlier tokens first inside an expert
    token_R, slot_R = order_R // A, order_R % A
    counts_E = torch.zeros(n_experts, dtype=torch.int64, device=flat_R.device).scatter_add_(
        0, flat_R, torch.ones_like(flat_R)
    )
    return token_R, slot_R, counts_E.cumsum(0).to(torch.int32)


class _GatherRows(torch.autograd.Function):
    """out_MD = src_ND[index_M], whose gradient is a gather too: every output row copies one source row, and
    copies_NK[n] lists the K output rows that copied row n, so grad_src[n] = sum_k grad_out[copies_NK[n, k]] (summed
    in float32 or wider). Autograd's own gradient of an index is a zero-filled scatter-add, several times slower on
    the GPU for the routed experts' un-permutes (BENCHMARKS.md, "MoE routing's gradients as gathers")."""

    @staticmethod
    def forward(ctx, src_ND: torch.Tensor, index_M: torch.Tensor, copies_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(copies_NK)
        return src_ND[index_M]

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor):
        (copies_NK,) = ctx.saved_tensors
        N, K = copies_NK.shape
        if K == 1:
            return grad_MD[copies_NK[:, 0]], None, None
        grad_NKD = grad_MD[copies_NK.reshape(-1)].view(N, K, *grad_MD.shape[1:])
        accumulate = torch.promote_types(grad_MD.dtype, torch.float32)
        return grad_NKD.sum(1, dtype=accumulate).to(grad_MD.dtype), None, None


def gather_rows(src_ND: torch.Tensor, index_M: torch.Tensor, copies_NK: torch.Tensor) -> torch.Tensor:
    """src_ND[index_M], differentiable in src through gathers (see _GatherRows); copies_NK[n] must list every row m
    with index_M[m] == n, each output row exactly once."""
    return _GatherRows.apply(src_ND, index_M, copies_NK)


# ---------------------------------------------------------------------------------------------------------------
# Grouped expert compute


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming grad contiguous: torch._grouped_mm's CPU backward fails on an
    expanded grad (e.g. from out.sum().backward())."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@torch.compiler.disable
def _grouped_mm_outside_compile(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x_MK, w_EKN, offs=offs_E)


def grouped_mm_hp(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """High-precision grouped GEMM: rows offs[e-1]:offs[e] of x times w[e].

    Under autocast both operands take autocast's dtype, as autocast does for matmuls: it has no rule for
    torch._grouped_mm, so fp32 master weights (one worker: no FSDP mixed precision) or fp32 activations made the
    bf16 experts run in fp32, and the product's bf16 MoE step ran several times slower than its fp8 one.
    """
    device_type = x_MK.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x_MK, w_EKN = x_MK.to(dtype), w_EKN.to(dtype)
    else:
        w_EKN = w_EKN.to(x_MK.dtype)
    if x_MK.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # torch._grouped_mm's fake-tensor rule admits bf16 only (torch 2.13), though fp32 runs eagerly on CPU:
        # leave the fp32 call out of the compiled graph.
        return _ContiguousGrad.apply(_grouped_mm_outside_compile(x_MK, w_EKN, offs_E))
    return _ContiguousGrad.apply(torch._grouped_mm(x_MK, w_EKN, offs=offs_E))


def grouped_mm_reference(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Per-expert loop with torch._grouped_mm's semantics. Test reference only (slow: one GEMM per expert)."""
    out_MN = x_MK.new_zeros(x_MK.shape[0], w_EKN.shape[-1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        out_MN[start:end] = x_MK[start:end] @ w_EKN[e].to(x_MK.dtype)
        start = end
    return out_MN


class GroupedExperts(nn.Module):
    """E SwiGLU experts computed with two grouped GEMMs.

    Weights are stored [E, out, in] like nn.Linear's (and torchtitan's and the Hugging Face checkpoints'):
    w13 [E, 2I, D] holds the gate projection w1 (rows :I) and the up projection w3 (rows I:) of every expert, so
    the tokens go through ONE grouped GEMM for both (an FP8 path quantizes x once) and w2 is [E, D, I]. The GEMMs
    see the column-major views w.transpose(-2, -1) ([E, in, out], torch._grouped_mm's right operand).

    `grouped_mm` is the swap point: fp8.convert_to_fp8 replaces it with an FP8 grouped GEMM of the same
    signature.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.n_experts = n_experts
        self.hidden_dim = hidden_dim
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = grouped_mm_hp

    @property
    def w1(self) -> torch.Tensor:
        """Gate projection [E, I, D] (a view of w13)."""
        return self.w13[:, : self.hidden_dim]

    @property
    def w3(self) -> torch.Tensor:
        """Up projection [E, I, D] (a view of w13)."""
        return self.w13[:, self.hidden_dim :]

    def forward(self, x_RD: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return self.swiglu(x_RD, offs_E, self.w13, self.w2)

    def swiglu(self, x_RD: torch.Tensor, offs_E: torch.Tensor, w13_EJD: torch.Tensor,
               w2_EDI: torch.Tensor) -> torch.Tensor:
        """The experts' SwiGLU on weights given explicitly: this module's own (forward), or the slice of the experts
        a rank holds under expert parallelism (the caller passes the local tensors of its sharded parameters)."""
        y13_RJ = self.grouped_mm(x_RD, w13_EJD.transpose(-2, -1), offs_E)
        h_RI = F.silu(y13_RJ[:, : self.hidden_dim]) * y13_RJ[:, self.hidden_dim :]
        return self.grouped_mm(h_RI, w2_EDI.transpose(-2, -1), offs_E)

    def init_weights(self, init_std: float, out_std: float) -> None:
        with torch.no_grad():
            nn.init.trunc_normal_(self.w13[:, : self.hidden_dim], mean=0.0, std=init_std)
            nn.init.trunc_normal_(self.w13[:, self.hidden_dim :], mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=out_std)


def routed_experts_reference(
    experts: GroupedExperts, x_SD: torch.Tensor, expert_SA: torch.Tensor, weight_SA: torch.Tensor
) -> torch.Tensor:
    """sum_a weight[s, a] * expert_{expert[s, a]}(x[s]) by a loop over experts: the test reference for the
    permute -> grouped GEMM -> un-permute path."""
    out_SD = torch.zeros(x_SD.shape, dtype=torch.float32, device=x_SD.device)
    for e in range(experts.n_experts):
        token_idx, slot_idx = torch.nonzero(expert_SA == e, as_tuple=True)
        x_nD = x_SD[token_idx]
        w1_ID, w3_ID, w2_DI = (w[e].to(x_SD.dtype) for w in (experts.w1, experts.w3, experts.w2))
        y_nD = (F.silu(x_nD @ w1_ID.t()) * (x_nD @ w3_ID.t())) @ w2_DI.t()
        out_SD = out_SD.index_add(0, token_idx, y_nD.float() * weight_SA[token_idx, slot_idx, None])
    return out_SD.to(x_SD.dtype)


def _in_backward() -> bool:
    """True while autograd runs backward, i.e. when activation checkpointing recomputes this forward: the
    assignment counts must not be added twice."""
    return torch._C._current_graph_task_id() != -1


def set_forward_recompute(model: nn.Module, may_rerun: bool) -> None:
    """Tell every MoE layer whether activation checkpointing can re-run its forward in backward (default True, the
    safe answer; False lets a compiled MoE block be one graph)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.forward_may_rerun_in_backward = may_rerun


class MoE(nn.Module):
    """Routed experts (top-k of E) plus shared experts, one layer's FFN."""

    def __init__(self, args: DeepSeekMoEArgs):
        super().__init__()
        self.args = args
        E = args.n_routed_experts
        self.gate = nn.Linear(args.dim, E, bias=False)  # the router; kept high precision (fp32 math below)
        self.experts = GroupedExperts(E, args.dim, args.moe_inter_dim)
        self.shared_experts = (
            FeedForward(args.dim, args.n_shared_experts * args.moe_inter_dim) if args.n_shared_experts else None
        )
        # Persistent: the aux-free bias is training state and must survive checkpoints.
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        # Assignments per expert summed over training forwards since the last bias update (all micro-batches).
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        self.last_aux_loss: torch.Tensor | None = None
        # Whether activation checkpointing may re-run this forward inside backward (then the counts must skip the
        # re-run). Asking autograd costs a graph break under torch.compile (a host call returning a Python int),
        # so models that are never recomputed turn the question off: see set_forward_recompute.
        self.forward_may_rerun_in_backward = True
        # Where the routed rows go: None runs them through self.experts here. Expert parallelism (applied from
        # outside, like FSDP) sets a callable (x_RD sorted by expert, offs_E over all E experts) -> y_RD in the same
        # order, which sends the rows to the ranks that hold their experts and brings the results back.
        self.expert_compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        a = self.args
        B, T, D = x_BTD.shape
        x_SD = x_BTD.reshape(B * T, D)
        logits_SE = F.linear(x_SD.float(), self.gate.weight.float())
        scores_SE, expert_SA, weight_SA = route(
            logits_SE, a.n_activated_experts, a.score_func,
            bias_E=self.expert_bias if a.aux_free_bias else None,
            route_norm=a.route_norm, route_scale=a.route_scale,
            n_groups=a.n_expert_groups, n_limited_groups=a.n_limited_groups,
        )
        kept_SA = None
        if a.capacity_factor is not None:
            cap = expert_capacity(B * T, a.n_activated_experts, a.n_routed_experts, a.capacity_factor)
            weight_SA, kept_SA = apply_capacity(expert_SA, weight_SA, a.n_routed_experts, cap)
        self.last_aux_loss = None
        if a.aux_loss_alpha > 0 and torch.is_grad_enabled():
            self.last_aux_loss = a.aux_loss_alpha * load_balance_loss(
                scores_SE.view(B, T, -1), expert_SA.view(B, T, -1), a.aux_loss_scope
            )
        if self.training and not (self.forward_may_rerun_in_backward and _in_backward()):
            with torch.no_grad():
                self.tokens_per_expert += expert_counts(expert_SA, a.n_routed_experts, kept_SA)

        out_SD = self.routed(x_SD, expert_SA, weight_SA)
        if self.shared_experts is not None:
            out_SD = out_SD + self.shared_experts(x_SD)
        return out_SD.view(B, T, D)

    def routed(self, x_SD: torch.Tensor, expert_SA: torch.Tensor, weight_SA: torch.Tensor) -> torch.Tensor:
        """permute -> grouped SwiGLU -> un-permute by a gather -> weighted sum over the A slots of each token."""
        S, A = expert_SA.shape
        token_R, slot_R, offs_E = permute_by_expert(expert_SA, self.experts.n_experts)
        # Row of y holding assignment (s, a): invert the sort (a scatter of positions). token_R / sorted_pos_SA and
        # sorted_pos_SA / assignment_R are inverse pairs, so both un-permutes' backward passes are gathers.
        assignment_R = token_R * A + slot_R
        arange_R = torch.arange(S * A, device=token_R.device)
        sorted_pos_SA = torch.empty_like(token_R).scatter_(0, assignment_R, arange_R).view(S, A)
        x_RD = gather_rows(x_SD, token_R, sorted_pos_SA)
        y_RD = self.experts(x_RD, offs_E) if self.expert_compute is None else self.expert_compute(x_RD, offs_E)
        y_SAD = gather_rows(y_RD, sorted_pos_SA.reshape(-1), assignment_R[:, None]).view(S, A, -1)
        # Mix in fp32 (one rounding at the end). A gather plus a weighted sum keeps only y and the weights for
        # backward, where an index_add un-permute would keep an extra fp32 copy.
        return (y_SAD.float() * weight_SA[..., None]).sum(1).to(x_SD.dtype)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """DeepSeek-V3: raise the bias of under-loaded experts, lower over-loaded ones, by a fixed step (times the
        0-d `gate`, 0 or 1, when given)."""
        step_E = self.args.bias_update_speed * torch.sign(counts_E.mean() - counts_E)
        self.expert_bias += step_E if gate is None else step_E * gate.to(step_E.dtype)

    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        self.experts.init_weights(init_std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std, out_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


# ---------------------------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents, a separate
# small rotary part of each head shared by all heads for keys. Naive (non-absorbed) form: the training form.


class MLAttention(nn.Module):
    def __init__(self, args: DeepSeekMoEArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.n_heads
        q = self.wq(x_BTD) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x_BTD)))
        q_nope, q_rope = q.view(B, T, H, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        q_BTHC = torch.cat([q_nope, apply_rope(q_rope, cos_TP, sin_TP)], dim=-1)
        kv_latent, k_rope = self.wkv_a(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope_BT1C = apply_rope(k_rope.unsqueeze(2), cos_TP, sin_TP)
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(B, T, H, self.nope_dim + self.v_dim)
        k_nope, v_BTHC = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_BTHC = torch.cat([k_nope, k_rope_BT1C.expand(-1, -1, H, -1)], dim=-1)
        o_BHTC = F.scaled_dot_product_attention(
            q_BTHC.transpose(1, 2), k_BTHC.transpose(1, 2), v_BTHC.transpose(1, 2), is_causal=True
        )
        return self.wo(o_BHTC.transpose(1, 2).reshape(B, T, -1))

    def init_weights(self, init_std: float, out_std: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                nn.init.trunc_normal_(getattr(self, name).weight, mean=0.0, std=init_std)
        for name in ("q_norm", "kv_norm"):
            if hasattr(self, name):
                getattr(self, name).reset_parameters()
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


# ---------------------------------------------------------------------------------------------------------------
# Block and model


class MoEBlock(DecoderBlock):
    def __init__(self, layer_id: int, args: DeepSeekMoEArgs):
        attention = Attention(args.dim, args.n_heads, args.n_heads) if args.attention == "mha" else MLAttention(args)
        super().__init__(layer_id, args.dim, args.norm_eps, attention)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)

    @property
    def ffn(self) -> nn.Module:
        return self.moe if self.moe_enabled else self.feed_forward


class DeepSeekMoE(Decoder):
    def __init__(self, args: DeepSeekMoEArgs):
        super().__init__(args, lambda layer_id: MoEBlock(layer_id, args))

    def rotary_frequencies(self, device: torch.device | None) -> torch.Tensor:
        return rope_frequencies(self.args.rope_head_dim, self.args.rope_theta, device=device)

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values() if layer.moe_enabled]

    def aux_loss(self) -> torch.Tensor:
        """Load-balancing loss of the last forward, already times aux_loss_alpha (0 when off or no grad)."""
        total = torch.zeros((), device=self.norm.weight.device)
        for moe in self.moe_layers():
            if moe.last_aux_loss is not None:
                total = total + moe.last_aux_loss
        return total

    @torch.no_grad()
    def update_load_balance_bias(self, reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                 gate: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step from the counts accumulated since the last call; then resets the counts.
        reduce_fn (optional) sums the stacked counts [n_moe_layers, E] over data-parallel ranks (e.g. an
        all_reduce) so every rank applies the same update. No-op unless args.aux_free_bias (counts still reset).
        gate (optional 0-d device tensor, 0 or 1): the update and the reset take effect only where it is 1 (a step
        the divergence guard will reject keeps its counts for the next kept step, as if this were not called)."""
        layers = self.moe_layers()
        if not layers:
            return
        counts_LE = torch.stack([moe.tokens_per_expert for moe in layers])
        if self.args.aux_free_bias:
            if reduce_fn is not None:
                counts_LE = reduce_fn(counts_LE)
            for moe, counts_E in zip(layers, counts_LE):
                moe.update_bias(counts_E, gate)
        for moe in layers:
            if gate is None:
                moe.tokens_per_expert.zero_()
            else:
                moe.tokens_per_expert.mul_(1 - gate.to(moe.tokens_per_expert.dtype))
