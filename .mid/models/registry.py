"""Model flavors and the factory that builds them on the meta device and initialises them on a target device.

conf/model/*.yaml name a flavor and may override some of its hyper-parameters (`build_model(name, overrides=...)`).
Published parameter counts sit beside each flavor so tests can check the meta-device build against them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.deepseek_moe import DeepSeekMoE, DeepSeekMoEArgs
from models.llama3 import Llama3, Llama3Args

FAMILIES: dict[str, tuple[type, type]] = {
    "llama3": (Llama3Args, Llama3),
    "deepseek_moe": (DeepSeekMoEArgs, DeepSeekMoE),
}


@dataclass(frozen=True)
class ModelFlavor:
    name: str
    family: str  # key of FAMILIES
    args: Llama3Args | DeepSeekMoEArgs
    planning_only: bool = False  # too large to ever materialise here; build on meta for planning
    published_total_params: float | None = None  # as published (model card / paper), for the tests
    published_active_params: float | None = None
    # Peak learning rate that train.lr=null resolves to: the published one where there is one. Far too high a rate
    # is a divergence the monitors then (rightly) act on: 3e-3, right for the debug flavors, made an 8B-width run of
    # the product loop diverge in bf16 and trip FP8's amax-growth detector.
    peak_lr: float = 3e-3
    # Tokens each GPU trains on per optimizer step when train.global_batch_size is left null on GPUs: 16k keeps an
    # H100 busy at the 4-layer widths of the benchmarks (the FP8 GEMMs win at that size, not at 16 x 128 tokens)
    # without the multi-million-token global batches of the papers, which take minutes per step on a few GPUs.
    tokens_per_gpu_step: int = 16384

    @property
    def is_moe(self) -> bool:
        return self.family == "deepseek_moe"


def _llama(**kw: Any) -> Llama3Args:
    return Llama3Args(**kw)


def _dsmoe(**kw: Any) -> DeepSeekMoEArgs:
    return DeepSeekMoEArgs(**kw)


MODEL_FLAVORS: dict[str, ModelFlavor] = {
    f.name: f
    for f in (
        # Tiny flavors for tests and the CPU default job: vocab 256 because the default data is bytes.
        ModelFlavor(
            "debug_dense", "llama3",
            _llama(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                   ffn_dim_multiplier=None, rope_theta=10000.0, rope_scaling_factor=None, max_seq_len=512),
        ),
        # Llama 3.2 1B (tied embeddings, rope factor 32): 1,235,814,400 parameters.
        ModelFlavor(
            "llama3_1b", "llama3",
            _llama(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256, ffn_dim_multiplier=1.5,
                   rope_scaling_factor=32.0, max_seq_len=8192, tie_embeddings=True),
            published_total_params=1_235_814_400, published_active_params=1_235_814_400,
            peak_lr=3e-4,  # not published for Llama 3.2 1B; the 8B's
        ),
        ModelFlavor(
            "llama3_8b", "llama3",
            _llama(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3),
            published_total_params=8_030_261_248, published_active_params=8_030_261_248,
            peak_lr=3e-4,  # Llama 3 paper (arXiv 2407.21783)
        ),
        ModelFlavor(
            "llama3_70b", "llama3",
            _llama(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3),
            published_total_params=70_553_706_496, published_active_params=70_553_706_496,
            peak_lr=1.5e-4,  # Llama 3 paper
        ),
        ModelFlavor(
            "debug_moe", "deepseek_moe",
            _dsmoe(dim=128, n_layers=3, n_heads=4, vocab_size=256, max_seq_len=512, n_dense_layers=1,
                   inter_dim=256, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                   moe_inter_dim=64, aux_loss_alpha=0.01),
        ),
        # DeepSeekMoE 16B (arXiv 2401.06066, deepseek-moe-16b-base): 16.4B total, 2.8B active.
        ModelFlavor(
            "deepseek_moe16b", "deepseek_moe",
            _dsmoe(dim=2048, n_layers=28, n_heads=16, vocab_size=102400, n_dense_layers=1, inter_dim=10944,
                   n_routed_experts=64, n_shared_experts=2, n_activated_experts=6, moe_inter_dim=1408,
                   aux_loss_alpha=0.001, aux_loss_scope="seq"),
            published_total_params=16.4e9, published_active_params=2.8e9,
            peak_lr=4.2e-4,  # DeepSeekMoE paper
        ),
        # DeepSeek-V3 shape (arXiv 2412.19437): MLA, 256 routed + 1 shared, top-8 in 4 of 8 groups, sigmoid
        # scores, aux-loss-free bias plus a tiny sequence loss. 671B total, 37B active (MTP module not included;
        # YaRN long-context rope scaling not modelled). Planning only.
        ModelFlavor(
            "deepseek_v3", "deepseek_moe",
            _dsmoe(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, max_seq_len=4096, n_dense_layers=3,
                   inter_dim=18432, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8,
                   moe_inter_dim=2048, score_func="sigmoid", route_norm=True, route_scale=2.5,
                   n_expert_groups=8, n_limited_groups=4, aux_loss_alpha=0.0001, aux_loss_scope="seq",
                   aux_free_bias=True, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
            planning_only=True, published_total_params=671e9, published_active_params=37e9,
            peak_lr=2.2e-4,  # DeepSeek-V3 report
        ),
    )
}


def get_flavor(name: str) -> ModelFlavor:
    if name not in MODEL_FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; known: {', '.join(MODEL_FLAVORS)}")
    return MODEL_FLAVORS[name]


def apply_overrides(flavor: ModelFlavor, overrides: dict[str, Any] | None) -> ModelFlavor:
    """A copy of the flavor with some args replaced; unknown keys raise ValueError naming the allowed ones."""
    if not overrides:
        return flavor
    fields = {f.name for f in dataclasses.fields(flavor.args)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown override(s) {unknown} for model {flavor.name!r} ({flavor.family}); allowed: {sorted(fields)}"
        )
    args = dataclasses.replace(flavor.args, **overrides)
    args.validate()
    return dataclasses.replace(flavor, args=args)


def resolve_flavor(name_or_flavor: str | ModelFlavor, overrides: dict[str, Any] | None = None) -> ModelFlavor:
    flavor = get_flavor(name_or_flavor) if isinstance(name_or_flavor, str) else name_or_flavor
    return apply_overrides(flavor, overrides)


def build_model(
    name_or_flavor: str | ModelFlavor,
    device: torch.device | str = "meta",
    overrides: dict[str, Any] | None = None,
    seed: int | None = 0,
    min_vocab_size: int = 0,
) -> nn.Module:
    """Build on the meta device (allocates nothing); for any other device, materialise there with to_empty()
    and run init_weights(seed). For FSDP, build on meta, shard, then to_empty + init_weights yourself.

    min_vocab_size: the token ids the training data holds (0..min_vocab_size-1: bytes, or a prepared corpus's
    tokenizer) must be rows of the vocabulary: a smaller one would fail at the first step (an index error in the
    embedding or the loss; on a GPU the fused FP8 head's loss kernel does not check targets). The launcher's config
    check refuses it before Ray starts; this covers a worker started without it (torchrun, tests)."""
    flavor = resolve_flavor(name_or_flavor, overrides)
    vocab = getattr(flavor.args, "vocab_size", None)
    if vocab is not None and vocab < min_vocab_size:
        raise ValueError(f"model {flavor.name} has vocab_size={vocab}, below the {min_vocab_size} token ids of the "
                         f"data; set model.overrides.vocab_size to at least {min_vocab_size}")
    device = torch.device(device)
    if flavor.planning_only and device.type != "meta":
        raise ValueError(f"model {flavor.name!r} is planning only: build it on device='meta' (dry_run=true)")
    _, model_cls = FAMILIES[flavor.family]
    with torch.device("meta"):
        model = model_cls(flavor.args)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights(seed)
    return model
