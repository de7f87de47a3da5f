"""Dry-run planning: exact parameter counts from a meta-device build, FLOPs per token, bytes per worker.

`plan_model(flavor, world_size=..., seq_len=..., micro_batch=...)` returns a JSON-serialisable `ModelPlan`.
Nothing is allocated: the model is built on the meta device and memory is estimated per worker as
  params + grads + optimizer states (sharded over the FSDP shard group)
  + FSDP working buffers (one unsharded block being used, the next prefetched, the root kept gathered)
  + activations saved for backward (with or without per-block activation checkpointing).
The activation estimate counts, per token and layer, the tensors autograd keeps for backward in these models
(see `block_activation_bytes_per_token`); tests/test_planning.py checks it against a measured CPU run.
What it leaves out: allocator fragmentation, CUDA/NCCL context and communication buffers, temporaries that live
only inside one kernel's backward: `fits` keeps a reserve fraction of the memory for those.
FP8: the layers that keep an fp8 copy of their weight from forward to backward (`fp8_weight_copy_layers`, named by
the caller, which knows the precision settings and the parallel layout: orchestration.training.model_setup) count 1
byte a weight as `fp8_weight_copies` (fp8_weight_copy_bytes); saved activations are still counted at
compute_dtype_bytes, so the FP8 estimate errs high there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from models.deepseek_moe import MLAttention, MoE
from models.llama3 import Attention, FeedForward
from models.registry import ModelFlavor, build_model, resolve_flavor

GIB = 1024**3
SHARDINGS = ("fsdp", "hsdp", "replicate")


@dataclass
class ParamCounts:
    total: int  # unique parameters (tied weights once)
    active: int  # per token: routed experts count top-k of E
    embedding: int  # input embedding table (a lookup, no FLOPs); 0 when tied to the output
    routed_experts: int


def count_params(model: nn.Module) -> ParamCounts:
    total = sum(p.numel() for p in model.parameters())
    inactive = routed = 0
    for module in model.modules():
        if isinstance(module, MoE):
            n = sum(p.numel() for p in module.experts.parameters())
            routed += n
            E, A = module.args.n_routed_experts, module.args.n_activated_experts
            inactive += n * (E - A) // E
    emb = model.tok_embeddings.weight
    embedding = 0 if emb is model.output.weight else emb.numel()
    return ParamCounts(total=total, active=total - inactive, embedding=embedding, routed_experts=routed)


# ---------------------------------------------------------------------------------------------------------------
# FLOPs


def attention_flops_per_token(model: nn.Module, seq_len: int) -> int:
    """Training (fwd + bwd) FLOPs of the score and value matmuls per token: 6 * L * H * (d_qk + d_v) * T, the
    full square as torchtitan/PaLM count it (causal masking would halve it)."""
    flops = 0
    for block in model.layers.values():
        attn = block.attention
        if isinstance(attn, MLAttention):
            d_qk, d_v = attn.nope_dim + attn.rope_dim, attn.v_dim
        else:
            d_qk = d_v = attn.head_dim
        flops += 6 * attn.n_heads * (d_qk + d_v) * seq_len
    return flops


def flops_per_token(model: nn.Module, seq_len: int, counts: ParamCounts | None = None) -> int:
    """6 * (active params without the embedding lookup) + attention, training FLOPs per token."""
    counts = counts or count_params(model)
    return 6 * (counts.active - counts.embedding) + attention_flops_per_token(model, seq_len)


# ---------------------------------------------------------------------------------------------------------------
# Activation bytes per token (a = bytes of the compute dtype). Inventory of what autograd saves:
#   RMSNorm: fp32 copy of its input, the normalised value, its output (input of the next matmuls): (4 + 2a) D.
#   SDPA (flash / memory efficient): q, k, v (k, v repeated to H heads), its output (wo's input is a view of it)
#   and the fp32 log-sum-exp per head. RoPE keeps nothing per token.
#   SwiGLU of width F: w1 and w3 outputs, silu output, the product (input of w2): 4 F a.
#   MoE: fp32 router input copy and scores, permuted rows, per routed row a SwiGLU of width I, the fp32 expert
#   output for the weighted mix, shared experts as a SwiGLU.
#   Loss: the fp32 log-softmax over the vocabulary.


def _norm_bytes(dim: int, a: int) -> int:
    return (4 + 2 * a) * dim


def _attention_bytes(attn: nn.Module, dim: int, a: int) -> int:
    if isinstance(attn, Attention):
        H, C = attn.n_heads, attn.head_dim
        # SDPA keeps q, k, v (k, v repeated to H heads) and its output, which wo's input views; rotary keeps
        # nothing per token (cos and sin need no grad).
        return 4 * H * C * a + 4 * H
    assert isinstance(attn, MLAttention)
    H, qk, v, r = attn.n_heads, attn.nope_dim + attn.rope_dim, attn.v_dim, attn.rope_dim
    q_rank = attn.wq_a.out_features if hasattr(attn, "wq_a") else 0
    q_path = (q_rank * a + _norm_bytes(q_rank, a)) if q_rank else 0
    kv_path = (attn.kv_lora_rank + r) * a + _norm_bytes(attn.kv_lora_rank, a)
    return (
        q_path + kv_path
        + H * qk * a + 4 * H * r + 4 * r  # q projection output; fp32 copies for the rotary parts
        + H * (attn.nope_dim + v) * a  # wkv_b output
        + 2 * H * qk * a + H * v * a  # SDPA inputs q, k, v
        + 2 * H * v * a + 4 * H  # SDPA output, wo input, log-sum-exp
    )


def _swiglu_bytes(hidden: int, a: int) -> int:
    return 4 * hidden * a


def _moe_bytes(moe: MoE, dim: int, a: int) -> int:
    args = moe.args
    A, E, I = args.n_activated_experts, args.n_routed_experts, args.moe_inter_dim
    shared = _swiglu_bytes(moe.shared_experts.w1.out_features, a) if moe.shared_experts is not None else 0
    # router input fp32 copy, scores; permuted rows; SwiGLU per routed row; fp32 expert output for the mix
    return 4 * dim + 8 * E + A * dim * a + A * _swiglu_bytes(I, a) + A * dim * 4 + shared


def block_activation_bytes_per_token(block: nn.Module, a: int) -> int:
    dim = block.attention_norm.weight.shape[0]
    ffn = block.moe if getattr(block, "moe_enabled", False) else block.feed_forward
    ffn_bytes = _moe_bytes(ffn, dim, a) if isinstance(ffn, MoE) else _swiglu_bytes(ffn.w1.out_features, a)
    assert isinstance(ffn, (MoE, FeedForward))
    return 2 * _norm_bytes(dim, a) + _attention_bytes(block.attention, dim, a) + ffn_bytes


def head_activation_bytes_per_token(model: nn.Module, a: int) -> int:
    """Final norm and the fp32 log-softmax the loss keeps (the logits themselves are not kept by autograd)."""
    dim, vocab = model.output.in_features, model.output.out_features
    return _norm_bytes(dim, a) + vocab * 4


def activation_bytes(model: nn.Module, tokens: int, a: int, checkpointing: bool) -> int:
    per_block = [block_activation_bytes_per_token(b, a) for b in model.layers.values()]
    head = head_activation_bytes_per_token(model, a)
    if not checkpointing:
        return tokens * (sum(per_block) + head)
    # Per-block checkpointing keeps each block's input; backward recomputes one block at a time.
    dim = model.output.in_features
    return tokens * (len(per_block) * dim * a + max(per_block) + head)


def fp8_weight_copy_bytes(model: nn.Module, layers: Iterable[str], checkpointing: bool) -> int:
    """Bytes of the fp8 weight copies the layers named keep from forward to backward: 1 a weight, unsharded (each
    layer casts the weight as gathered); a group of routed experts counts all its weights. Without checkpointing
    every copy is alive when the forward ends. With per-block checkpointing a block keeps its copies only while its
    backward runs (after the recompute), and the layers outside the blocks (the head) free theirs before the first
    block's backward: the larger of the two."""
    per_block: dict[str | None, int] = {}
    for name in layers:
        module = model.get_submodule(name)
        n = module.weight.numel() if isinstance(module, nn.Linear) else sum(p.numel() for p in module.parameters())
        block = name.split(".")[1] if name.startswith("layers.") else None
        per_block[block] = per_block.get(block, 0) + n
    outside = per_block.pop(None, 0)
    if checkpointing:
        return max(outside, max(per_block.values(), default=0))
    return outside + sum(per_block.values())


# ---------------------------------------------------------------------------------------------------------------
# The plan


@dataclass
class MemoryBytes:
    params: int
    grads: int
    optimizer: int  # AdamW m and v in fp32, plus an fp32 master copy when params are stored below fp32
    fsdp_buffers: int  # unsharded working copies (0 without sharding)
    activations: int
    fp8_weight_copies: int = 0  # kept by FP8 layers from forward to backward (fp8_weight_copy_bytes)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.fsdp_buffers + self.activations + self.fp8_weight_copies

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclass
class ModelPlan:
    model: str
    family: str
    total_params: int
    active_params: int
    embedding_params: int
    flops_per_token: int  # training FLOPs (fwd + bwd) per token at seq_len
    world_size: int
    sharding: str
    shard_degree: int
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool
    param_dtype_bytes: int
    compute_dtype_bytes: int
    bytes_per_worker: MemoryBytes  # with the configured activation_checkpointing
    activation_bytes_no_ac: int
    activation_bytes_ac: int
    fp8_copy_bytes_no_ac: int = 0
    fp8_copy_bytes_ac: int = 0
    notes: list[str] = field(default_factory=list)

    def usable_bytes(self, memory_bytes_per_worker: int, reserve_fraction: float = 0.1) -> float:
        return memory_bytes_per_worker * (1.0 - reserve_fraction)

    def fits(self, memory_bytes_per_worker: int, reserve_fraction: float = 0.1) -> bool:
        """True when the estimate fits in the worker's memory minus a reserve (context, fragmentation, NCCL)."""
        return self.bytes_per_worker.total <= self.usable_bytes(memory_bytes_per_worker, reserve_fraction)

    def fit_reasons(self, memory_bytes_per_worker: int, reserve_fraction: float = 0.1) -> list[str]:
        usable = self.usable_bytes(memory_bytes_per_worker, reserve_fraction)
        need = self.bytes_per_worker.total
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.bytes_per_worker.to_dict().items() if k != "total")
        head = (
            f"needs {need / GIB:.2f} GiB per worker ({parts}) of {usable / GIB:.2f} GiB usable "
            f"({memory_bytes_per_worker / GIB:.2f} GiB minus {reserve_fraction:.0%} reserve)"
        )
        if need <= usable:
            return [f"fits: {head}"]
        reasons = [f"does not fit: {head}"]
        if not self.activation_checkpointing:
            with_ac = (need - self.activation_bytes_no_ac - self.fp8_copy_bytes_no_ac + self.activation_bytes_ac
                       + self.fp8_copy_bytes_ac)
            if with_ac <= usable:
                reasons.append(f"activation_checkpointing=true would need {with_ac / GIB:.2f} GiB and fit")
        state = self.bytes_per_worker.params + self.bytes_per_worker.grads + self.bytes_per_worker.optimizer
        state_unsharded = state * self.shard_degree
        room = (usable - self.bytes_per_worker.activations - self.bytes_per_worker.fsdp_buffers
                - self.bytes_per_worker.fp8_weight_copies)
        if room > 0:
            min_shards = math.ceil(state_unsharded / room)
            if min_shards > self.shard_degree:
                reasons.append(
                    f"parameter, gradient and optimizer state need sharding over >= {min_shards} workers "
                    f"(now {self.shard_degree}, sharding={self.sharding})"
                )
        else:
            reasons.append(self._what_leaves_no_room(usable))
        return reasons

    def _what_leaves_no_room(self, usable: float) -> str:
        """The term that leaves no memory for the sharded states, named by size (sharding more cannot help it)."""
        acts, bufs = self.bytes_per_worker.activations, self.bytes_per_worker.fsdp_buffers
        if acts >= usable:
            return (f"activations alone ({acts / GIB:.2f} GiB for micro-batch {self.micro_batch} x seq "
                    f"{self.seq_len}) exceed the usable memory: lower micro_batch or seq_len, or turn on "
                    "activation checkpointing")
        if bufs >= usable:
            return (f"FSDP's gathered buffers alone ({bufs / GIB:.2f} GiB: the root and the largest blocks "
                    "unsharded) exceed the usable memory: more workers cannot help; use GPUs with more memory")
        state = self.bytes_per_worker.params + self.bytes_per_worker.grads + self.bytes_per_worker.optimizer
        return (f"activations ({acts / GIB:.2f} GiB) plus FSDP's gathered buffers ({bufs / GIB:.2f} GiB) leave no room "
                f"in {usable / GIB:.2f} GiB for the parameter, gradient and optimizer states ({state / GIB:.2f} GiB "
                f"at {self.shard_degree} shard(s)): lower micro_batch or seq_len, or turn on activation checkpointing")

    def to_dict(self, memory_bytes_per_worker: int | None = None, reserve_fraction: float = 0.1) -> dict[str, Any]:
        """Plain JSON types. With memory_bytes_per_worker it adds `fits` and `reasons`."""
        out = dataclasses.asdict(self)
        out["bytes_per_worker"] = self.bytes_per_worker.to_dict()
        if memory_bytes_per_worker is not None:
            out["memory_bytes_per_worker"] = int(memory_bytes_per_worker)
            out["fits"] = self.fits(memory_bytes_per_worker, reserve_fraction)
            out["reasons"] = self.fit_reasons(memory_bytes_per_worker, reserve_fraction)
        return out


def plan_model(
    flavor: str | ModelFlavor,
    *,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    sharding: str = "fsdp",
    shard_degree: int | None = None,
    activation_checkpointing: bool = False,
    param_dtype_bytes: int = 4,
    compute_dtype_bytes: int = 2,
    overrides: dict[str, Any] | None = None,
    model: nn.Module | None = None,
    fp8_weight_copy_layers: Iterable[str] = (),
) -> ModelPlan:
    """Plan one configuration. sharding: "fsdp" shards states over all world_size workers; "hsdp" over groups
    of shard_degree (replicated across groups); "replicate" keeps full copies (DDP). param_dtype_bytes is the
    storage dtype of the parameters (FSDP2's usual setup: 4, fp32 sharded params with bf16 compute);
    compute_dtype_bytes that of the gathered params and activations. `model`: a meta-built model to reuse.
    fp8_weight_copy_layers: the FP8 layers that keep an fp8 copy of their weight for backward
    (orchestration.training.model_setup.fp8_weight_copy_layers)."""
    flavor = resolve_flavor(flavor, overrides)
    if world_size < 1 or seq_len < 1 or micro_batch < 1:
        raise ValueError(f"world_size, seq_len, micro_batch must be >= 1, got {world_size}, {seq_len}, {micro_batch}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r}; choose one of {SHARDINGS}")
    if param_dtype_bytes not in (2, 4) or compute_dtype_bytes not in (1, 2, 4):
        raise ValueError("param_dtype_bytes must be 2 or 4 and compute_dtype_bytes 1, 2 or 4")
    if sharding == "fsdp":
        shard_degree = world_size
    elif sharding == "replicate":
        shard_degree = 1
    elif shard_degree is None or shard_degree < 1 or world_size % shard_degree:
        raise ValueError(f"sharding='hsdp' needs shard_degree dividing world_size={world_size}, got {shard_degree}")
    if seq_len > flavor.args.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds max_seq_len={flavor.args.max_seq_len} of {flavor.name}")

    model = model if model is not None else build_model(flavor, device="meta")
    counts = count_params(model)
    p, c = param_dtype_bytes, compute_dtype_bytes
    master = 4 if p < 4 else 0
    tokens = micro_batch * seq_len

    def sharded(n: int) -> int:
        return math.ceil(n / shard_degree)

    fsdp_buffers = 0
    if shard_degree > 1:
        block_params = [sum(q.numel() for q in b.parameters()) for b in model.layers.values()]
        root_params = counts.total - sum(block_params)
        biggest = max(block_params)
        # Root (embeddings, norm, output) stays gathered through the step; one block in use plus one prefetched;
        # the fp32 unsharded gradient of the biggest unit before its reduce-scatter.
        fsdp_buffers = root_params * c + 2 * biggest * c + max(biggest, root_params) * 4

    act_no_ac = activation_bytes(model, tokens, c, checkpointing=False)
    act_ac = activation_bytes(model, tokens, c, checkpointing=True)
    copy_layers = tuple(fp8_weight_copy_layers)
    fp8_no_ac, fp8_ac = (fp8_weight_copy_bytes(model, copy_layers, checkpointing=ac) for ac in (False, True))
    mem = MemoryBytes(
        params=sharded(counts.total) * p,
        grads=sharded(counts.total) * p,
        optimizer=sharded(counts.total) * (8 + master),
        fsdp_buffers=fsdp_buffers,
        activations=act_ac if activation_checkpointing else act_no_ac,
        fp8_weight_copies=fp8_ac if activation_checkpointing else fp8_no_ac,
    )
    notes = []
    if flavor.planning_only:
        notes.append(f"{flavor.name} is planning only (not trainable in this project)")
    if flavor.is_moe:
        notes.append("MoE: routed-expert activations assume the static S*top_k row layout (dropless)")
    return ModelPlan(
        model=flavor.name, family=flavor.family, total_params=counts.total, active_params=counts.active,
        embedding_params=counts.embedding, flops_per_token=flops_per_token(model, seq_len, counts),
        world_size=world_size, sharding=sharding, shard_degree=shard_degree, seq_len=seq_len,
        micro_batch=micro_batch, activation_checkpointing=activation_checkpointing, param_dtype_bytes=p,
        compute_dtype_bytes=c, bytes_per_worker=mem, activation_bytes_no_ac=act_no_ac, activation_bytes_ac=act_ac,
        fp8_copy_bytes_no_ac=fp8_no_ac, fp8_copy_bytes_ac=fp8_ac, notes=notes,
    )


def smallest_fitting_world_size(
    flavor: str | ModelFlavor,
    memory_bytes_per_worker: int,
    *,
    max_world_size: int,
    reserve_fraction: float = 0.1,
    **plan_kwargs: Any,
) -> int | None:
    """Smallest FSDP world size in [1, max_world_size] whose plan fits, or None. Builds the model once."""
    flavor = resolve_flavor(flavor, plan_kwargs.pop("overrides", None))
    model = build_model(flavor, device="meta")
    for ws in range(1, max_world_size + 1):
        plan = plan_model(flavor, world_size=ws, model=model, **plan_kwargs)
        if plan.fits(memory_bytes_per_worker, reserve_fraction):
            return ws
    return None
