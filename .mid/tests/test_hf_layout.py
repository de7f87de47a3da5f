"""The Hugging Face layouts (orchestration/interop/layout.py) against the published models' facts: the tensor names and
shapes of deepseek-ai/deepseek-moe-16b-base, the config.json of Llama 3.1 8B and Llama 3.2 1B against our presets,
the q/k row permutation, and the partial reads a sharded rank makes. Pure functions, no files."""

from __future__ import annotations

import pytest
import torch

from models.registry import get_flavor
from orchestration.interop.import_hf import meta_shapes
from orchestration.interop.layout import (
    LayoutError,
    TensorMap,
    args_from_hf_config,
    args_of,
    hf_config_from_args,
    hf_shapes,
    mismatched_fields,
    qk_from_hf,
    qk_to_hf,
    rows_from_hf,
    tensor_maps,
    to_hf,
)

# config.json of deepseek-ai/deepseek-moe-16b-base as published (the keys that describe the architecture).
DEEPSEEK_MOE_16B_CONFIG = {
    "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek", "attention_bias": False,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944, "max_position_embeddings": 4096,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 28,
    "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000,
    "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 102400,
}
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
LLAMA_32_1B_CONFIG = {
    **LLAMA_31_8B_CONFIG, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA_31_8B_CONFIG["rope_scaling"], "factor": 32.0},
}


def published_deepseek_moe_16b_tensors() -> dict[str, tuple[int, ...]]:
    """Every tensor of deepseek-moe-16b-base's safetensors files with its shape, from the published layout
    (modeling_deepseek.py: DeepseekMLP gate/up/down_proj, MoEGate.weight [experts, hidden], shared experts one
    DeepseekMLP of width moe_intermediate_size * n_shared_experts, layer 0 dense)."""
    D, V, I_dense, I_moe, E = 2048, 102400, 10944, 1408, 64
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for layer in range(28):
        p = f"model.layers.{layer}."
        out.update({f"{p}self_attn.{x}_proj.weight": (D, D) for x in "qkvo"})
        out.update({f"{p}input_layernorm.weight": (D,), f"{p}post_attention_layernorm.weight": (D,)})
        if layer == 0:
            out.update({f"{p}mlp.gate_proj.weight": (I_dense, D), f"{p}mlp.up_proj.weight": (I_dense, D),
                        f"{p}mlp.down_proj.weight": (D, I_dense)})
            continue
        out[f"{p}mlp.gate.weight"] = (E, D)
        for e in range(E):
            out.update({f"{p}mlp.experts.{e}.gate_proj.weight": (I_moe, D), f"{p}mlp.experts.{e}.up_proj.weight":
                        (I_moe, D), f"{p}mlp.experts.{e}.down_proj.weight": (D, I_moe)})
        out.update({f"{p}mlp.shared_experts.gate_proj.weight": (2 * I_moe, D),
                    f"{p}mlp.shared_experts.up_proj.weight": (2 * I_moe, D),
                    f"{p}mlp.shared_experts.down_proj.weight": (D, 2 * I_moe)})
    return out


def layout_tensors(flavor_name: str) -> dict[str, tuple[int, ...]]:
    flavor = get_flavor(flavor_name)
    shapes = meta_shapes(flavor.family, flavor.args)
    out = {}
    for tmap in tensor_maps(flavor.family, flavor.args):
        out.update(zip(tmap.hf, hf_shapes(tmap, shapes[tmap.ours]), strict=True))
    return out


def test_deepseek_moe_16b_layout_covers_every_published_tensor_with_its_shape():
    published = published_deepseek_moe_16b_tensors()
    ours = layout_tensors("deepseek_moe16b")
    assert sorted(ours) == sorted(published)
    assert ours == published
    # 16.4B parameters as the model card says, and every one of our parameters has a place in the layout
    assert sum(torch.Size(s).numel() for s in published.values()) == pytest.approx(16.38e9, rel=1e-3)
    flavor = get_flavor("deepseek_moe16b")
    assert {t.ours for t in tensor_maps(flavor.family, flavor.args)} == set(meta_shapes(flavor.family, flavor.args))


def test_published_configs_agree_with_our_presets_and_round_trip():
    for config, preset in ((DEEPSEEK_MOE_16B_CONFIG, "deepseek_moe16b"), (LLAMA_31_8B_CONFIG, "llama3_8b"),
                           (LLAMA_32_1B_CONFIG, "llama3_1b")):
        family, fields = args_from_hf_config(config)
        flavor = get_flavor(preset)
        assert family == flavor.family
        theirs = args_of(family, fields)
        assert mismatched_fields(family, flavor.args, theirs) == [], preset
        # our config.json for those arguments reads back as the same arguments
        again = args_from_hf_config(hf_config_from_args(family, theirs, torch.bfloat16))
        assert again == (family, fields)
    # and the published tensor names of Llama 3 8B: 291 tensors
    assert len(layout_tensors("llama3_8b")) == 2 + 32 * 9 + 1


def test_a_preset_differing_from_config_json_is_reported_by_field():
    family, fields = args_from_hf_config({**LLAMA_31_8B_CONFIG, "num_key_value_heads": 4})
    diff = mismatched_fields(family, get_flavor("llama3_8b").args, args_of(family, fields))
    assert diff == [("kv_heads", "num_key_value_heads", 8, 4)]
    _, fields = args_from_hf_config({**LLAMA_31_8B_CONFIG, "rope_scaling": None})
    diff = mismatched_fields(family, get_flavor("llama3_8b").args, args_of(family, fields))
    assert diff == [("rope_scaling_factor", "rope_scaling.factor", 8.0, None)]


@pytest.mark.parametrize(("change", "field"), [
    ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"head_dim": 256}, "head_dim"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_size": None}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "malformed value"),
    ({"hidden_size": "big"}, "malformed value"),
])
def test_unsupported_llama_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(LayoutError, match=field):
        args_from_hf_config({**LLAMA_31_8B_CONFIG, **change})


@pytest.mark.parametrize(("change", "field"), [
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
])
def test_unsupported_deepseek_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(LayoutError, match=field):
        args_from_hf_config({**DEEPSEEK_MOE_16B_CONFIG, **change})


def test_qk_permutation_maps_rotate_half_pairs_to_interleaved_pairs():
    heads, C, D = 3, 8, 5
    w_hf = torch.randn(heads * C, D)
    ours = qk_from_hf(w_hf, heads)
    for h in range(heads):
        for p in range(C // 2):
            # HF pairs rows p and p + C/2 of a head; we pair rows 2p and 2p + 1
            assert torch.equal(ours[h * C + 2 * p], w_hf[h * C + p])
            assert torch.equal(ours[h * C + 2 * p + 1], w_hf[h * C + C // 2 + p])
    assert torch.equal(qk_to_hf(ours, heads), w_hf)


def test_partial_reads_equal_rows_of_the_full_parameter_for_every_split():
    """What an FSDP2 rank reads (rows start:stop of a parameter, split anywhere, inside heads or experts, empty)
    equals those rows of the whole parameter converted at once."""
    torch.manual_seed(0)
    E, I, D, heads, C = 3, 4, 6, 2, 4
    hf = {f"g{e}": torch.randn(I, D) for e in range(E)} | {f"u{e}": torch.randn(I, D) for e in range(E)}
    hf |= {f"d{e}": torch.randn(D, I) for e in range(E)} | {"q": torch.randn(heads * C, D), "n": torch.randn(7, D)}
    reads = []

    def read(name, start, stop):
        reads.append((name, start, stop))
        return hf[name] if start is None else hf[name][start:stop]

    maps = [(TensorMap("q", ("q",), "qk", heads), (heads * C, D)), (TensorMap("n", ("n",)), (7, D)),
            (TensorMap("w13", tuple(f"{k}{e}" for e in range(E) for k in "gu"), "w13"), (E, 2 * I, D)),
            (TensorMap("w2", tuple(f"d{e}" for e in range(E)), "w2"), (E, D, I))]
    for tmap, shape in maps:
        full = rows_from_hf(tmap, read, 0, shape[0], shape)
        assert full.shape == shape
        # to_hf inverts it
        assert all(torch.equal(a, hf[n]) for a, n in zip(to_hf(tmap, full), tmap.hf, strict=True))
        for start in range(shape[0] + 1):
            for stop in range(start, shape[0] + 1):
                reads.clear()
                assert torch.equal(rows_from_hf(tmap, read, start, stop, shape), full[start:stop])
                if start == stop:
                    assert reads == []
                elif tmap.kind == "qk":  # only the heads holding the rows
                    (_, first, last), = reads
                    assert first == start // C * C and last == -(-stop // C) * C
                elif tmap.kind in ("w13", "w2"):  # only the experts start:stop
                    assert len(reads) == (stop - start) * (2 if tmap.kind == "w13" else 1)
