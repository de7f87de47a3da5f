"""Which Hugging Face tensor holds which of our parameters, and config.json <-> our model arguments. Pure functions.

Supported layouts:
  LlamaForCausalLM (model_type "llama"): Llama 3 / 3.1 / 3.2, RoPE without scaling or with the "llama3" scaling,
    grouped-query attention, tied or untied embeddings.
  DeepseekForCausalLM (model_type "deepseek"): the deepseek-ai/deepseek-moe-16b-base layout - the first
    first_k_dense_replace layers dense, then MoE layers with a softmax router (mlp.gate.weight), routed experts
    (mlp.experts.E.{gate,up,down}_proj) and the shared experts fused into one SwiGLU (mlp.shared_experts.*).

Two conventions differ from ours:
  - RoPE. Hugging Face rotates halves (x[i] with x[i + C/2]); we rotate interleaved pairs (x[2p] with x[2p+1]), as
    Meta's checkpoints. The q and k projections' rows are therefore permuted inside each head: our row
    h*C + 2p + j is Hugging Face's row h*C + j*C/2 + p (j in {0, 1}, p < C/2).
  - Experts. Ours are stacked: w13 [E, 2I, D] holds expert e's gate (rows :I) and up (rows I:) projections, w2
    [E, D, I] its down projection; Hugging Face keeps one Linear per expert and projection.

Shape legend: E experts, I expert hidden dim, D model dim, H heads, C head dim, P = C/2, R rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from models.deepseek_moe import DeepSeekMoEArgs
from models.llama3 import Llama3Args

LLAMA_ARCH = "LlamaForCausalLM"
DEEPSEEK_ARCH = "DeepseekForCausalLM"
FAMILY_OF_ARCH = {LLAMA_ARCH: "llama3", DEEPSEEK_ARCH: "deepseek_moe"}
ARCH_OF_FAMILY = {family: arch for arch, family in FAMILY_OF_ARCH.items()}
# model=from_hf resolves to this preset of the family with every architecture field of config.json as an override:
# the preset then only contributes what config.json cannot say (its published peak learning rate).
BASE_FLAVOR = {"llama3": "llama3_8b", "deepseek_moe": "deepseek_moe16b"}
# Tensors some checkpoints carry that hold no weights (recomputed RoPE tables of older transformers versions).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
HF_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class LayoutError(ValueError):
    """A checkpoint directory or config.json that this layout cannot read; the message names the field or tensor."""


# ---------------------------------------------------------------------------------------------------------------
# config.json -> our arguments


def family_of(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    known = [a for a in archs if a in FAMILY_OF_ARCH]
    if not known:
        raise LayoutError(f"config.json architectures={archs!r} is not a supported layout; supported: "
                          f"{sorted(FAMILY_OF_ARCH)}")
    return FAMILY_OF_ARCH[known[0]]


def _need(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise LayoutError(f"config.json has no {key}")
    return config[key]


def _refuse_unless(ok: bool, key: str, value: Any, what: str) -> None:
    if not ok:
        raise LayoutError(f"config.json {key}={value!r}: {what}")


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from either the classic keys (rope_theta, rope_scaling) or transformers
    5's rope_parameters."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise LayoutError("config.json has no rope_theta (nor rope_parameters.rope_theta)")
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def _common_checks(config: dict[str, Any]) -> None:
    _refuse_unless(config.get("hidden_act", "silu") == "silu", "hidden_act", config.get("hidden_act"),
                   "only silu (SwiGLU) is supported")
    _refuse_unless(not config.get("attention_bias", False), "attention_bias", config.get("attention_bias"),
                   "projections with biases are not supported")
    _refuse_unless(not config.get("mlp_bias", False), "mlp_bias", config.get("mlp_bias"),
                   "projections with biases are not supported")
    heads, dim = _need(config, "num_attention_heads"), _need(config, "hidden_size")
    head_dim = config.get("head_dim")
    _refuse_unless(head_dim is None or head_dim * heads == dim, "head_dim", head_dim,
                   f"must be hidden_size / num_attention_heads = {dim // heads} (a separate head size is not "
                   "supported)")


def args_from_hf_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(family, our model arguments as a dict) from a config.json; LayoutError naming the field it cannot take."""
    try:
        return _args_from_hf_config(config)
    except LayoutError:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # a value of the wrong type, a rope_scaling without its keys
        raise LayoutError(f"config.json has a malformed value ({type(exc).__name__}: {exc})") from None


def _args_from_hf_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    family = family_of(config)
    _common_checks(config)
    theta, scaling = _rope(config)
    common = {
        "dim": int(_need(config, "hidden_size")),
        "n_layers": int(_need(config, "num_hidden_layers")),
        "n_heads": int(_need(config, "num_attention_heads")),
        "vocab_size": int(_need(config, "vocab_size")),
        "norm_eps": float(_need(config, "rms_norm_eps")),
        "rope_theta": theta,
        "max_seq_len": int(_need(config, "max_position_embeddings")),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }
    if family == "llama3":
        out = {**common, "n_kv_heads": int(config.get("num_key_value_heads") or common["n_heads"]),
               "ffn_hidden_dim": int(_need(config, "intermediate_size")), "rope_scaling_factor": None}
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            _refuse_unless(kind == "llama3", "rope_scaling", scaling,
                           "only the llama3 RoPE scaling (or none) is supported")
            out.update(rope_scaling_factor=float(scaling["factor"]),
                       rope_low_freq_factor=float(scaling["low_freq_factor"]),
                       rope_high_freq_factor=float(scaling["high_freq_factor"]),
                       rope_original_max_seq_len=int(scaling["original_max_position_embeddings"]))
        return family, out
    _refuse_unless(scaling is None, "rope_scaling", scaling, "RoPE scaling is not supported for DeepSeek-MoE")
    kv_heads = config.get("num_key_value_heads") or common["n_heads"]
    _refuse_unless(kv_heads == common["n_heads"], "num_key_value_heads", kv_heads,
                   f"DeepSeek-MoE attention here is multi-head: must equal num_attention_heads={common['n_heads']}")
    _refuse_unless(config.get("moe_layer_freq", 1) == 1, "moe_layer_freq", config.get("moe_layer_freq"),
                   "only 1 (every layer after the dense ones is MoE) is supported")
    _refuse_unless(config.get("scoring_func", "softmax") == "softmax", "scoring_func", config.get("scoring_func"),
                   "only softmax routing is supported for this layout")
    return family, {
        **common,
        "n_dense_layers": int(config.get("first_k_dense_replace") or 0),
        "inter_dim": int(_need(config, "intermediate_size")),
        "n_routed_experts": int(_need(config, "n_routed_experts")),
        "n_shared_experts": int(config.get("n_shared_experts") or 0),
        "n_activated_experts": int(_need(config, "num_experts_per_tok")),
        "moe_inter_dim": int(_need(config, "moe_intermediate_size")),
        "score_func": "softmax",
        "route_norm": bool(config.get("norm_topk_prob", False)),
        "aux_loss_alpha": float(config.get("aux_loss_alpha", 0.001)),
        "aux_loss_scope": "seq" if config.get("seq_aux", True) else "batch",
        "attention": "mha",
    }


# Architecture fields a preset must share with config.json (our attribute, config.json's key). Training-only settings
# (aux_loss_alpha, capacity_factor) and max_seq_len (it sizes the RoPE tables, no weight depends on it) are free.
COMPARED_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "llama3": (("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads"),
               ("kv_heads", "num_key_value_heads"), ("vocab_size", "vocab_size"),
               ("hidden_dim", "intermediate_size"), ("norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"),
               ("rope_scaling_factor", "rope_scaling.factor"), ("tie_embeddings", "tie_word_embeddings")),
    "deepseek_moe": (("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads"),
                     ("vocab_size", "vocab_size"), ("norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"),
                     ("tie_embeddings", "tie_word_embeddings"), ("n_dense_layers", "first_k_dense_replace"),
                     ("inter_dim", "intermediate_size"), ("n_routed_experts", "n_routed_experts"),
                     ("n_shared_experts", "n_shared_experts"), ("n_activated_experts", "num_experts_per_tok"),
                     ("moe_inter_dim", "moe_intermediate_size"), ("score_func", "scoring_func"),
                     ("route_norm", "norm_topk_prob"), ("attention", "(multi-head attention)")),
}
LLAMA_SCALING_FIELDS = (("rope_low_freq_factor", "rope_scaling.low_freq_factor"),
                        ("rope_high_freq_factor", "rope_scaling.high_freq_factor"),
                        ("rope_original_max_seq_len", "rope_scaling.original_max_position_embeddings"))


def args_of(family: str, fields: dict[str, Any]) -> Llama3Args | DeepSeekMoEArgs:
    cls = Llama3Args if family == "llama3" else DeepSeekMoEArgs
    args = cls(**fields)
    try:
        args.validate()
    except ValueError as exc:
        raise LayoutError(f"config.json describes a model this code cannot build: {exc}") from None
    return args


def mismatched_fields(family: str, ours: Any, theirs: Any) -> list[tuple[str, str, Any, Any]]:
    """(our field, config.json key, our value, config.json's) for each architecture field that differs."""
    fields = list(COMPARED_FIELDS[family])
    if family == "llama3" and ours.rope_scaling_factor is not None and theirs.rope_scaling_factor is not None:
        fields += LLAMA_SCALING_FIELDS
    return [(attr, key, getattr(ours, attr), getattr(theirs, attr)) for attr, key in fields
            if getattr(ours, attr) != getattr(theirs, attr)]


def exportable(family: str, args: Any) -> None:
    """LayoutError when the model has something the Hugging Face layout cannot hold."""
    if family != "deepseek_moe":
        return
    for attr, expected in (("attention", "mha"), ("score_func", "softmax"), ("n_expert_groups", 1),
                           ("route_scale", 1.0), ("aux_free_bias", False)):
        if getattr(args, attr) != expected:
            raise LayoutError(f"the model has {attr}={getattr(args, attr)!r}; the {DEEPSEEK_ARCH} layout "
                              f"(deepseek-moe-16b) holds only {attr}={expected!r}")


# ---------------------------------------------------------------------------------------------------------------
# our arguments -> config.json


def hf_config_from_args(family: str, args: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of a model with `args`, its weights stored in `dtype`."""
    exportable(family, args)
    common = {
        "architectures": [ARCH_OF_FAMILY[family]],
        "hidden_act": "silu",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if family == "llama3":
        scaling = None
        if args.rope_scaling_factor is not None:
            scaling = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                       "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                       "original_max_position_embeddings": args.rope_original_max_seq_len}
        return {**common, "model_type": "llama", "num_key_value_heads": args.kv_heads,
                "head_dim": args.head_dim, "intermediate_size": args.hidden_dim, "mlp_bias": False,
                "rope_scaling": scaling, "pretraining_tp": 1}
    return {
        **common,
        "model_type": "deepseek",
        # As published: the model's code ships beside the weights (trust_remote_code); copy configuration_deepseek.py
        # and modeling_deepseek.py from deepseek-ai/deepseek-moe-16b-base into the directory to load it.
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekConfig",
                     "AutoModel": "modeling_deepseek.DeepseekModel",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"},
        "num_key_value_heads": args.n_heads,
        "first_k_dense_replace": args.n_dense_layers,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "moe_layer_freq": 1,
        "n_routed_experts": args.n_routed_experts,
        "n_shared_experts": args.n_shared_experts or None,
        "num_experts_per_tok": args.n_activated_experts,
        "norm_topk_prob": args.route_norm,
        "scoring_func": "softmax",
        "aux_loss_alpha": args.aux_loss_alpha,
        "seq_aux": args.aux_loss_scope == "seq",
        "rope_scaling": None,
        "pretraining_tp": 1,
    }


# ---------------------------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the Hugging Face tensors it is made of.

    kind: "copy" (the same tensor), "qk" (rows permuted inside each of `heads` heads, see the module docstring),
    "w13" (hf = gate_0, up_0, gate_1, up_1, ...: expert e's gate and up stacked), "w2" (hf = down_0, down_1, ...).
    """

    ours: str
    hf: tuple[str, ...]
    kind: str = "copy"
    heads: int = 0


def tensor_maps(family: str, args: Any) -> list[TensorMap]:
    """Every parameter of the model, in checkpoint order (embedding, blocks, final norm, head)."""
    maps = [TensorMap("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    kv_heads = args.kv_heads if family == "llama3" else args.n_heads
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        maps += [
            TensorMap(f"{ours}attention_norm.weight", (f"{hf}input_layernorm.weight",)),
            TensorMap(f"{ours}attention.wq.weight", (f"{hf}self_attn.q_proj.weight",), "qk", args.n_heads),
            TensorMap(f"{ours}attention.wk.weight", (f"{hf}self_attn.k_proj.weight",), "qk", kv_heads),
            TensorMap(f"{ours}attention.wv.weight", (f"{hf}self_attn.v_proj.weight",)),
            TensorMap(f"{ours}attention.wo.weight", (f"{hf}self_attn.o_proj.weight",)),
            TensorMap(f"{ours}ffn_norm.weight", (f"{hf}post_attention_layernorm.weight",)),
        ]
        if family == "llama3" or i < args.n_dense_layers:
            maps += _swiglu(f"{ours}feed_forward.", f"{hf}mlp.")
            continue
        experts = range(args.n_routed_experts)
        maps += [
            TensorMap(f"{ours}moe.gate.weight", (f"{hf}mlp.gate.weight",)),
            TensorMap(f"{ours}moe.experts.w13", tuple(f"{hf}mlp.experts.{e}.{proj}_proj.weight"
                                                      for e in experts for proj in ("gate", "up")), "w13"),
            TensorMap(f"{ours}moe.experts.w2", tuple(f"{hf}mlp.experts.{e}.down_proj.weight" for e in experts), "w2"),
        ]
        if args.n_shared_experts:
            maps += _swiglu(f"{ours}moe.shared_experts.", f"{hf}mlp.shared_experts.")
    maps.append(TensorMap("norm.weight", ("model.norm.weight",)))
    if not args.tie_embeddings:
        maps.append(TensorMap("output.weight", ("lm_head.weight",)))
    return maps


def _swiglu(ours: str, hf: str) -> list[TensorMap]:
    return [TensorMap(f"{ours}w1.weight", (f"{hf}gate_proj.weight",)),
            TensorMap(f"{ours}w3.weight", (f"{hf}up_proj.weight",)),
            TensorMap(f"{ours}w2.weight", (f"{hf}down_proj.weight",))]


def hf_shapes(tmap: TensorMap, our_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shape of each of tmap.hf for our parameter of shape `our_shape`."""
    if tmap.kind == "w13":
        E, J, D = our_shape
        return [(J // 2, D)] * (2 * E)
    if tmap.kind == "w2":
        return [tuple(our_shape[1:])] * our_shape[0]
    return [tuple(our_shape)]


def qk_from_hf(w_RD: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows -> our interleaved-pair rows (whole heads)."""
    R, D = w_RD.shape
    C = R // heads
    return w_RD.reshape(heads, 2, C // 2, D).transpose(1, 2).reshape(R, D)


def qk_to_hf(w_RD: torch.Tensor, heads: int) -> torch.Tensor:
    R, D = w_RD.shape
    C = R // heads
    return w_RD.reshape(heads, C // 2, 2, D).transpose(1, 2).reshape(R, D)


def to_hf(tmap: TensorMap, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Our full parameter -> the Hugging Face tensors of tmap.hf, in that order."""
    if tmap.kind == "qk":
        return [qk_to_hf(tensor, tmap.heads).contiguous()]
    if tmap.kind == "w13":
        half = tensor.shape[1] // 2
        return [part.contiguous() for e in range(tensor.shape[0])
                for part in (tensor[e, :half], tensor[e, half:])]
    if tmap.kind == "w2":
        return [tensor[e].contiguous() for e in range(tensor.shape[0])]
    return [tensor]


# read(name, start, stop) -> rows start:stop of Hugging Face tensor `name` (None, None: all of it)
RowReader = Callable[[str, "int | None", "int | None"], torch.Tensor]


def rows_from_hf(tmap: TensorMap, read: RowReader, start: int, stop: int, our_shape: tuple[int, ...]) -> torch.Tensor:
    """Rows start:stop (dimension 0) of our parameter, reading only what they need: for q/k the whole heads that
    hold them, for experts the experts start:stop."""
    if stop <= start:
        return torch.empty((0, *our_shape[1:]))
    if tmap.kind == "copy":
        full = start == 0 and stop == our_shape[0]
        return read(tmap.hf[0], None, None) if full else read(tmap.hf[0], start, stop)
    if tmap.kind == "qk":
        C = our_shape[0] // tmap.heads
        first, last = start // C, math.ceil(stop / C)
        block = qk_from_hf(read(tmap.hf[0], first * C, last * C), last - first)
        return block[start - first * C: stop - first * C]
    if tmap.kind == "w13":
        return torch.stack([torch.cat([read(tmap.hf[2 * e], None, None), read(tmap.hf[2 * e + 1], None, None)])
                            for e in range(start, stop)])
    assert tmap.kind == "w2", tmap.kind
    return torch.stack([read(tmap.hf[e], None, None) for e in range(start, stop)])


