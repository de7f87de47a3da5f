"""Llama3: parity with transformers' LlamaForCausalLM, RoPE scaling, published parameter counts, init, training."""

import time

import pytest
import torch
import torch.nn.functional as F
import transformers  # a dev dependency: missing must fail, not skip

from models.llama3 import Llama3, Llama3Args, rope_frequencies
from models.registry import MODEL_FLAVORS, build_model, get_flavor


def _tiny_args() -> Llama3Args:
    # GQA (4 query heads over 2 kv heads), Llama 3.1 rope scaling on: head dim 16 has frequencies in all three
    # bands (kept, smoothed, divided) of the default original_max_seq_len 8192.
    return Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16,
                      ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling_factor=8.0, max_seq_len=64)


def _hf_config(a: Llama3Args):
    return transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.hidden_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads,
        # HF checks the rope's original length against this; our tables are sized by max_seq_len instead.
        max_position_embeddings=max(a.max_seq_len, a.rope_original_max_seq_len),
        rms_norm_eps=a.norm_eps, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": a.rope_theta, "factor": a.rope_scaling_factor,
                         "low_freq_factor": a.rope_low_freq_factor, "high_freq_factor": a.rope_high_freq_factor,
                         "original_max_position_embeddings": a.rope_original_max_seq_len},
    )


def _hf_to_meta_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # HF stores wq/wk rows per head as [first halves | second halves] (rotate-half rope); Meta interleaves pairs.
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


@torch.no_grad()
def _copy_from_hf(ours: Llama3, hf) -> None:
    a = ours.args
    ours.tok_embeddings.weight.copy_(hf.model.embed_tokens.weight)
    ours.norm.weight.copy_(hf.model.norm.weight)
    ours.output.weight.copy_(hf.lm_head.weight)
    for i, hl in enumerate(hf.model.layers):
        layer = ours.layers[str(i)]
        layer.attention_norm.weight.copy_(hl.input_layernorm.weight)
        layer.ffn_norm.weight.copy_(hl.post_attention_layernorm.weight)
        layer.attention.wq.weight.copy_(_hf_to_meta_rows(hl.self_attn.q_proj.weight, a.n_heads))
        layer.attention.wk.weight.copy_(_hf_to_meta_rows(hl.self_attn.k_proj.weight, a.kv_heads))
        layer.attention.wv.weight.copy_(hl.self_attn.v_proj.weight)
        layer.attention.wo.weight.copy_(hl.self_attn.o_proj.weight)
        layer.feed_forward.w1.weight.copy_(hl.mlp.gate_proj.weight)
        layer.feed_forward.w3.weight.copy_(hl.mlp.up_proj.weight)
        layer.feed_forward.w2.weight.copy_(hl.mlp.down_proj.weight)


def test_logits_match_transformers_llama_fp32():
    torch.manual_seed(0)
    a = _tiny_args()
    config = _hf_config(a)
    config._attn_implementation = "eager"  # an attention independent of scaled_dot_product_attention
    hf = transformers.LlamaForCausalLM(config).eval()
    # HF inits norms to ones: perturb them so a swapped norm weight would show.
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    ours = Llama3(a).eval()
    ours.init_weights(seed=1)
    _copy_from_hf(ours, hf)
    tokens = torch.randint(0, a.vocab_size, (2, 48))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.dtype == torch.float32 and got.shape == (2, 48, a.vocab_size)
    assert ref.abs().max() > 0.1  # not a trivially small comparison
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_rope_llama3_scaling_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    a = Llama3Args(dim=512, n_heads=4, rope_theta=500000.0, rope_scaling_factor=8.0)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(a), "cpu")
    ours = rope_frequencies(a.head_dim, a.rope_theta, 8.0, 1.0, 4.0, 8192).float()
    torch.testing.assert_close(ours, hf_inv_freq, rtol=1e-6, atol=0)
    plain = rope_frequencies(a.head_dim, a.rope_theta).float()
    # High frequencies untouched, the lowest divided by the factor exactly.
    assert ours[0] == plain[0] and torch.isclose(ours[-1], plain[-1] / 8.0)
    assert ((ours < plain) & (ours > plain / 8)).any()  # the smoothed band exists at head dim 128


@pytest.mark.parametrize(
    "name, expected",
    [("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496), ("llama3_1b", 1_235_814_400)],
)
def test_published_parameter_counts_on_meta(name, expected):
    # Published: Llama 3 8B 8,030,261,248; 70B 70,553,706,496; Llama 3.2 1B 1,235,814,400 (tied embeddings).
    model = build_model(name)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected == get_flavor(name).published_total_params


def test_hidden_dim_rule():
    assert MODEL_FLAVORS["llama3_8b"].args.hidden_dim == 14336
    assert MODEL_FLAVORS["llama3_70b"].args.hidden_dim == 28672
    assert MODEL_FLAVORS["llama3_1b"].args.hidden_dim == 8192


def test_init_is_deterministic_and_tied_embeddings_survive_to_empty():
    m1 = build_model("debug_dense", "cpu", seed=3)
    m2 = build_model("debug_dense", "cpu", seed=3)
    m3 = build_model("debug_dense", "cpu", seed=4)
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p1, p2), n
    assert not torch.equal(m1.layers["0"].attention.wq.weight, m3.layers["0"].attention.wq.weight)
    # Depth-scaled output projections: layer 1's wo std is 0.02 / sqrt(4), layer 0's 0.02 / sqrt(2).
    assert abs(m1.layers["1"].attention.wo.weight.std().item() - 0.01) < 0.002
    tied = build_model("debug_dense", "cpu", overrides={"tie_embeddings": True})
    assert tied.output.weight is tied.tok_embeddings.weight
    assert sum(p.numel() for p in tied.parameters()) == 434_816 - 256 * 128


def test_user_errors_are_value_errors():
    with pytest.raises(ValueError, match="unknown model flavor"):
        get_flavor("llama9")
    with pytest.raises(ValueError, match="unknown override"):
        build_model("debug_dense", overrides={"n_layer": 3})
    with pytest.raises(ValueError, match="n_kv_heads"):
        build_model("debug_dense", overrides={"n_kv_heads": 3})
    model = build_model("debug_dense", "cpu", overrides={"max_seq_len": 16})
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_overrides_change_the_build():
    model = build_model("debug_dense", overrides={"n_layers": 3, "vocab_size": 512})
    assert len(model.layers) == 3 and model.output.weight.shape == (512, 128)


def _train_steps(model, steps: int, batch=8, seq=128):
    torch.manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + model.aux_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_load_balance_bias()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def test_debug_dense_training_reduces_loss_and_is_fast():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("debug_dense", "cpu", seed=0)
        losses, times = _train_steps(model, 6)
    finally:
        torch.set_num_threads(threads)
    assert losses[-1] < losses[0] - 0.5, losses  # memorising one batch: 6.0 -> about 4.8
    assert sorted(times)[len(times) // 2] < 1.0, times  # batch 8 x seq 128 on one core: about 0.06 s measured
