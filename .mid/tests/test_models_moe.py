"""DeepSeek-MoE: grouped path vs per-expert loop, routing, capacity, load balance, counts, training."""

import time

import pytest
import torch
import torch.nn.functional as F

from models.deepseek_moe import (
    DeepSeekMoEArgs,
    GroupedExperts,
    MoE,
    apply_capacity,
    expert_capacity,
    gather_rows,
    grouped_mm_reference,
    load_balance_loss,
    permute_by_expert,
    route,
    routed_experts_reference,
)
from models.registry import build_model, get_flavor


def _moe(**kw) -> MoE:
    args = DeepSeekMoEArgs(dim=32, n_heads=4, n_routed_experts=6, n_activated_experts=2, n_shared_experts=1,
                           moe_inter_dim=16, **kw)
    moe = MoE(args)
    torch.manual_seed(0)
    moe.init_weights(0.2, 0.2)
    return moe


def _routing(moe, x_SD):
    _, expert_SA, weight_SA = route(moe.gate(x_SD), 2)
    # Leave expert 5 without tokens: an empty group must work in both paths.
    expert_SA = torch.where(expert_SA == 5, torch.zeros_like(expert_SA), expert_SA)
    expert_SA[:, 1] = torch.where(expert_SA[:, 1] == expert_SA[:, 0], (expert_SA[:, 0] + 1) % 5, expert_SA[:, 1])
    return expert_SA, weight_SA


def test_grouped_path_equals_per_expert_loop_forward_and_grads():
    moe = _moe()
    torch.manual_seed(1)
    x_SD = torch.randn(20, 32)
    grad_out = torch.randn(20, 32)
    results = []
    for path in ("grouped", "loop"):
        moe.zero_grad(set_to_none=True)
        x = x_SD.clone().requires_grad_(True)
        expert_SA, weight_SA = _routing(moe, x)
        if path == "grouped":
            out = moe.routed(x, expert_SA, weight_SA)
        else:
            out = routed_experts_reference(moe.experts, x, expert_SA, weight_SA)
        out.backward(grad_out)
        params = [moe.gate.weight, moe.experts.w13, moe.experts.w2]
        results.append([out.detach(), x.grad] + [p.grad.clone() for p in params])
    got, want = results
    assert got[0].abs().max() > 0.1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert moe.experts.w13.grad[5].abs().max() == 0  # the empty expert gets no gradient
    assert moe.gate.weight.grad.abs().max() > 0  # gradient reaches the router through the mixing weights


def test_torch_grouped_mm_semantics_match_loop_reference():
    torch.manual_seed(0)
    x_MK, w_EKN = torch.randn(24, 16), torch.randn(3, 16, 8)
    offs_E = torch.tensor([5, 5, 24], dtype=torch.int32)
    torch.testing.assert_close(torch._grouped_mm(x_MK, w_EKN, offs=offs_E), grouped_mm_reference(x_MK, w_EKN, offs_E))


def test_permutation_layout():
    expert_SA = torch.tensor([[2, 0], [2, 1], [0, 2]])
    token_R, slot_R, offs_E = permute_by_expert(expert_SA, 4)
    assert expert_SA[token_R, slot_R].tolist() == [0, 0, 1, 2, 2, 2]  # sorted by expert
    assert token_R.tolist() == [0, 2, 1, 0, 1, 2]  # earlier tokens first inside an expert
    assert offs_E.dtype == torch.int32 and offs_E.tolist() == [2, 3, 6, 6]  # cumulative ends; expert 3 empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_gradients_equal_autograds_scatter_add(dtype):
    """Both un-permutes of the routed path: tokens copied A times (x_SD[token_R]) and a permutation of the expert
    outputs (y_RD[sorted_pos]); the gathered gradient matches the sum in float64 (bf16: bit for bit; float32:
    within its rounding) and, for the permutation, equals autograd's gradient of plain indexing. Float64 gradients
    are summed in float64, and an empty source works."""
    torch.manual_seed(0)
    S, A, E, D = 40, 3, 5, 24
    expert_SA = torch.stack([torch.randperm(E)[:A] for _ in range(S)])
    token_R, slot_R, _ = permute_by_expert(expert_SA, E)
    assignment_R = token_R * A + slot_R
    sorted_pos_SA = torch.empty_like(token_R).scatter_(0, assignment_R, torch.arange(S * A)).view(S, A)
    x_SD = torch.randn(S, D, dtype=dtype, requires_grad=True)
    grad_RD = torch.randn(S * A, D, dtype=dtype)
    x_RD = gather_rows(x_SD, token_R, sorted_pos_SA)
    assert torch.equal(x_RD, x_SD[token_R])
    x_RD.backward(grad_RD)
    want = torch.zeros(S, D, dtype=torch.float64).index_add_(0, token_R, grad_RD.double())
    if dtype == torch.bfloat16:  # three bf16 normal draws add exactly in float32: one rounding, as in float64
        assert torch.equal(x_SD.grad, want.to(dtype))
    else:
        torch.testing.assert_close(x_SD.grad.double(), want, rtol=2e-7, atol=1e-7)

    y_RD = torch.randn(S * A, D, dtype=dtype, requires_grad=True)
    grad_SAD = torch.randn(S, A, D, dtype=dtype)
    y_SAD = gather_rows(y_RD, sorted_pos_SA.reshape(-1), assignment_R[:, None]).view(S, A, D)
    assert torch.equal(y_SAD, y_RD[sorted_pos_SA])
    y_SAD.backward(grad_SAD)
    y_ref = y_RD.detach().clone().requires_grad_(True)
    y_ref[sorted_pos_SA].backward(grad_SAD)
    assert torch.equal(y_RD.grad, y_ref.grad)

    x64_SD = torch.randn(S, D, dtype=torch.float64, requires_grad=True)
    gather_rows(x64_SD, token_R, sorted_pos_SA).backward(grad_RD.double())
    want64 = torch.zeros(S, D, dtype=torch.float64).index_add_(0, token_R, grad_RD.double())
    torch.testing.assert_close(x64_SD.grad, want64, rtol=1e-12, atol=1e-12)  # a float32 sum is off by ~1e-8
    empty = torch.zeros(0, D, dtype=dtype, requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)
    gather_rows(empty, none, none.view(0, A)).sum().backward()
    assert empty.grad.shape == (0, D)


def test_route_topk_weights_bias_and_groups():
    logits_SE = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.1, 0.2, 5.0]])
    scores_SE, expert_SA, weight_SA = route(logits_SE, 2)
    assert expert_SA.tolist() == [[1, 2], [3, 2]]
    torch.testing.assert_close(weight_SA, scores_SE.gather(1, expert_SA))
    torch.testing.assert_close(scores_SE.sum(-1), torch.ones(2))
    # Normalised weights sum to one; route_scale multiplies.
    _, _, w_norm = route(logits_SE, 2, route_norm=True, route_scale=2.0)
    torch.testing.assert_close(w_norm.sum(-1), torch.full((2,), 2.0))
    # The aux-free bias changes the choice, not the weight of a chosen expert.
    bias_E = torch.tensor([10.0, 0.0, 0.0, 0.0])
    _, expert_b, weight_b = route(logits_SE, 2, bias_E=bias_E)
    assert expert_b[:, 0].tolist() == [0, 0]
    torch.testing.assert_close(weight_b[:, 0], scores_SE[:, 0])
    # Group-limited: 2 groups of 2 ranked by the sum of their best two scores, keep 1 group. Expert 0 has the
    # best single score, but group {2, 3} wins (2 e^4.5 > e^5 + e^-9), so both picks come from it.
    logits_g = torch.tensor([[5.0, -9.0, 4.5, 4.5]])
    assert 0 in route(logits_g, 2)[1][0].tolist()
    _, expert_g, _ = route(logits_g, 2, n_groups=2, n_limited_groups=1)
    assert sorted(expert_g[0].tolist()) == [2, 3]
    # Sigmoid scores are independent per expert.
    scores_sig, _, _ = route(logits_SE, 2, score_func="sigmoid")
    torch.testing.assert_close(scores_sig, logits_SE.sigmoid())


def test_capacity_drops_later_assignments():
    expert_SA = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weight_SA = torch.ones(4, 2)
    cap = expert_capacity(4, 2, 4, capacity_factor=1.0)
    assert cap == 2  # ceil(1.0 * 4 tokens * 2 / 4 experts)
    w, kept = apply_capacity(expert_SA, weight_SA, 4, cap)
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert w.tolist() == [[1, 1], [1, 1], [0, 1], [1, 0]]
    for e in range(4):
        assert int(kept[expert_SA == e].sum()) <= cap


def test_capacity_in_layer_zeroes_dropped_contributions():
    moe = _moe(capacity_factor=0.5)
    x_BTD = torch.randn(1, 12, 32)
    with torch.no_grad():
        out = moe(x_BTD)
        ref = routed_experts_reference(moe.experts, x_BTD[0], *_capped_routing(moe, x_BTD[0])) + moe.shared_experts(
            x_BTD[0]
        )
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def _capped_routing(moe, x_SD):
    _, expert_SA, weight_SA = route(moe.gate(x_SD), 2)
    cap = expert_capacity(12, 2, 6, 0.5)  # = 2 per expert, so some of the 24 assignments drop
    w, kept = apply_capacity(expert_SA, weight_SA, 6, cap)
    assert not kept.all()
    return expert_SA, w


def test_aux_loss_hand_checked():
    # One sequence, 4 tokens, 2 experts, top-1. probs and choices picked by hand:
    probs = torch.tensor([[[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]])
    choice = torch.tensor([[[0], [0], [1], [0]]])
    # f = E / (A T) * counts = 2/4 * [3, 1] = [1.5, 0.5]; P = mean probs = [0.65, 0.35]
    # loss = 1.5 * 0.65 + 0.5 * 0.35 = 1.15
    assert load_balance_loss(probs, choice, "seq").item() == pytest.approx(1.15, abs=1e-6)
    # Perfect balance gives exactly 1.
    even = torch.full((1, 4, 2), 0.5)
    assert load_balance_loss(even, torch.tensor([[[0], [1], [0], [1]]]), "seq").item() == pytest.approx(1.0)
    # Two sequences each unbalanced in opposite ways: per-sequence loss sees it, the batch loss does not.
    probs2 = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])
    choice2 = torch.tensor([[[0], [0]], [[1], [1]]])
    assert load_balance_loss(probs2, choice2, "seq").item() == pytest.approx(2.0)
    assert load_balance_loss(probs2, choice2, "batch").item() == pytest.approx(1.0)


def test_model_aux_loss_is_alpha_weighted_sum_and_differentiable():
    model = build_model("debug_moe", "cpu", seed=0)
    tokens = torch.randint(0, 256, (2, 16))
    inputs = []
    for moe in model.moe_layers():
        moe.register_forward_hook(lambda m, args, out: inputs.append((m, args[0].detach())))
    model(tokens)
    aux = model.aux_loss()
    n_moe = len(model.moe_layers())
    assert n_moe == 2 and len(inputs) == n_moe
    # The sum over MoE layers of alpha times each layer's load-balance loss of its own routing, recomputed from the
    # layer's input with route() and load_balance_loss() (each tested above against hand-made cases).
    want = 0.0
    for moe, x_BTD in inputs:
        a = moe.args
        B, T, D = x_BTD.shape
        logits_SE = F.linear(x_BTD.reshape(B * T, D).float(), moe.gate.weight.float())
        scores_SE, expert_SA, _ = route(logits_SE, a.n_activated_experts, a.score_func,
                                        bias_E=moe.expert_bias if a.aux_free_bias else None,
                                        route_norm=a.route_norm, route_scale=a.route_scale,
                                        n_groups=a.n_expert_groups, n_limited_groups=a.n_limited_groups)
        layer_loss = load_balance_loss(scores_SE.view(B, T, -1), expert_SA.view(B, T, -1), a.aux_loss_scope).item()
        assert layer_loss >= 1.0 - 1e-6  # >= 1, with equality only at perfect balance
        want += a.aux_loss_alpha * layer_loss
    assert a.aux_loss_alpha == 0.01
    assert aux.item() == pytest.approx(want, rel=1e-6)
    aux.backward()
    assert model.layers["1"].moe.gate.weight.grad.abs().max() > 0
    with torch.no_grad():
        model(tokens)
    assert model.aux_loss().item() == 0.0  # no aux loss under no_grad (evaluation)


def test_aux_free_bias_update_from_counts():
    model = build_model("debug_moe", "cpu", overrides={"aux_free_bias": True, "aux_loss_alpha": 0.0})
    model.train()
    moe = model.layers["1"].moe
    model(torch.randint(0, 256, (2, 16)))
    counts = moe.tokens_per_expert.clone()
    assert counts.sum().item() == 2 * 16 * 2  # tokens x top-2
    model.update_load_balance_bias()
    expected = 0.001 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(moe.expert_bias, expected)
    assert moe.tokens_per_expert.sum().item() == 0  # counts reset after the update
    # reduce_fn sees the stacked per-layer counts (e.g. an all_reduce across ranks).
    model(torch.randint(0, 256, (2, 16)))
    seen = []
    model.update_load_balance_bias(reduce_fn=lambda c: seen.append(c.shape) or c * 2)
    assert seen == [torch.Size([2, 8])]
    assert "expert_bias" in dict(moe.named_buffers()) and "layers.1.moe.expert_bias" in model.state_dict()


def test_aux_free_bias_update_gated_on_the_device():
    """A gate of 0 (a step the divergence guard rejects) leaves the bias and keeps the counts for the next kept
    step; a gate of 1 is the ungated update."""
    model = build_model("debug_moe", "cpu", overrides={"aux_free_bias": True, "aux_loss_alpha": 0.0})
    moe = model.layers["1"].moe
    model(torch.randint(0, 256, (2, 16)))
    counts = moe.tokens_per_expert.clone()
    model.update_load_balance_bias(gate=torch.zeros(()))
    assert moe.expert_bias.abs().sum() == 0 and torch.equal(moe.tokens_per_expert, counts)
    model.update_load_balance_bias(gate=torch.ones(()))
    torch.testing.assert_close(moe.expert_bias, 0.001 * torch.sign(counts.mean() - counts))
    assert moe.tokens_per_expert.sum().item() == 0


def test_aux_free_off_keeps_bias_zero():
    model = build_model("debug_moe", "cpu")
    model(torch.randint(0, 256, (2, 16)))
    model.update_load_balance_bias()
    assert model.layers["1"].moe.expert_bias.abs().sum() == 0


def test_deepseek_moe16b_counts_on_meta():
    model = build_model("deepseek_moe16b")
    total = sum(p.numel() for p in model.parameters())
    assert total == 16_375_728_128
    from models.planning import count_params

    counts = count_params(model)
    assert counts.total == total and counts.active == 2_828_650_496
    # Published (DeepSeekMoE paper / model card): 16.4B total, 2.8B activated. Tolerance 1% (rounding of the
    # published figures: 16.38 -> 16.4 and 2.83 -> 2.8).
    flavor = get_flavor("deepseek_moe16b")
    assert abs(total / flavor.published_total_params - 1) < 0.01
    assert abs(counts.active / flavor.published_active_params - 1) < 0.011
    layer = model.layers["1"].moe
    assert layer.experts.w13.shape == (64, 2 * 1408, 2048) and layer.experts.w2.shape == (64, 2048, 1408)
    assert layer.experts.w1.shape == layer.experts.w3.shape == (64, 1408, 2048)
    assert isinstance(layer.gate, torch.nn.Linear) and model.layers["0"].feed_forward.w1.out_features == 10944


def test_deepseek_v3_shape_counts_on_meta():
    from models.planning import count_params

    counts = count_params(build_model("deepseek_v3"))
    # Published (DeepSeek-V3 report): 671B total, 37B activated, main model without the MTP module.
    # Tolerance 2% (37B is rounded from 37.5B).
    assert abs(counts.total / 671e9 - 1) < 0.005
    assert abs(counts.active / 37e9 - 1) < 0.02
    with pytest.raises(ValueError, match="planning only"):
        build_model("deepseek_v3", "cpu")


def test_mla_attention_runs_and_is_causal():
    model = build_model(
        "debug_moe", "cpu",
        overrides={"attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                   "qk_rope_head_dim": 8, "v_head_dim": 16, "score_func": "sigmoid", "route_norm": True,
                   "n_expert_groups": 2, "n_limited_groups": 1, "aux_free_bias": True},
    )
    tokens = torch.randint(0, 256, (2, 12))
    logits = model(tokens)
    tokens2 = tokens.clone()
    tokens2[:, 8:] = (tokens2[:, 8:] + 1) % 256
    logits2 = model(tokens2)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:, :8], logits2[:, :8])  # a later token never changes an earlier logit
    assert not torch.allclose(logits[:, 8:], logits2[:, 8:])


def test_debug_moe_training_reduces_loss_and_is_fast():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("debug_moe", "cpu", seed=0)
        torch.manual_seed(0)
        tokens = torch.randint(0, 256, (8, 129))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, times = [], []
        for _ in range(6):
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.update_load_balance_bias()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[-1] < losses[0] - 0.5, losses  # 6.0 -> about 4.85 measured
    assert sorted(times)[len(times) // 2] < 1.0, times  # about 0.1 s measured on one core


def test_bf16_forward_backward_on_cpu():
    model = build_model("debug_moe", "cpu", seed=0).to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()  # the expanded-grad case the ENV notes warn about
    assert torch.isfinite(model.layers["1"].moe.experts.w2.grad.float()).all()


def test_counts_not_doubled_by_activation_checkpointing_recompute():
    from torch.utils.checkpoint import checkpoint

    model = build_model("debug_moe", "cpu", seed=0)
    block = model.layers["1"]
    x = torch.randn(2, 16, 128, requires_grad=True)
    out = checkpoint(block, x, model.rope_cos, model.rope_sin, use_reentrant=False)
    out.float().pow(2).mean().backward()  # the backward recomputes the block's forward
    assert block.moe.tokens_per_expert.sum().item() == 2 * 16 * 2


def test_moe_block_compiles_to_one_graph_when_not_recomputed():
    """Asking autograd whether backward is re-running the forward breaks a compiled block's graph; a model built
    without activation checkpointing (set_forward_recompute(model, False)) must not ask."""
    from models.deepseek_moe import set_forward_recompute

    model = build_model("debug_moe", "cpu", seed=0).to(torch.bfloat16).train()
    block = model.layers["1"]
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    args = (x, model.rope_cos[:16], model.rope_sin[:16])
    assert torch._dynamo.explain(block)(*args).graph_break_count > 0  # the safe default asks
    torch._dynamo.reset()
    set_forward_recompute(model, False)
    before = block.moe.tokens_per_expert.clone()
    explained = torch._dynamo.explain(block)(*args)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert block.moe.tokens_per_expert.sum() > before.sum()  # the counts are still kept


def test_fp8_moe_block_compiles_to_one_graph_and_matches_eager_grads():
    """The FP8 grouped GEMMs are custom-op nodes (fp8.grouped "opaque" mode): a converted MoE block is still one
    graph, and its compiled gradients equal the eager ones (aot_eager: the same kernels, traced)."""
    import fp8
    from models.deepseek_moe import set_forward_recompute

    grads = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = build_model("debug_moe", "cpu", seed=0).to(torch.bfloat16).train()
        set_forward_recompute(model, False)
        fp8.convert_to_fp8(model, "rowwise")
        block = model.layers["1"]
        x = torch.randn(2, 16, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        args = (x, model.rope_cos[:16], model.rope_sin[:16])
        if compiled:
            explained = torch._dynamo.explain(block)(*args)
            assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
            torch._dynamo.reset()
            block.compile(backend="aot_eager", fullgraph=True)
        block(*args).float().pow(2).mean().backward()
        grads[compiled] = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    assert any("experts.w13" in n for n in grads[True])
    for name, g in grads[False].items():
        assert (g != 0).any(), name
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("compiled", [False, True])
def test_experts_of_fp32_weights_run_in_the_autocast_dtype(compiled):
    """One worker keeps fp32 master weights and trains under bf16 autocast, which has no rule for
    torch._grouped_mm: the experts must still compute in bf16 (they ran in fp32, 3.3x slower on the H200), with
    fp32 gradients for the fp32 weights."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 48)
    experts.init_weights(0.2, 0.2)
    x_RD = torch.randn(64, 32, requires_grad=True)
    offs_E = torch.tensor([16, 24, 48, 64], dtype=torch.int32)
    fn = torch.compile(experts, dynamic=False) if compiled else experts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(x_RD, offs_E)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert experts.w13.grad.dtype == torch.float32 and x_RD.grad.dtype == torch.float32
    # The same numbers as the module run on bf16 copies of the input and weights.
    ref = GroupedExperts(4, 32, 48)
    ref.load_state_dict(experts.state_dict())
    ref.to(torch.bfloat16)
    ref_fn = torch.compile(ref, dynamic=False) if compiled else ref  # Inductor rounds fused SwiGLUs once, eager twice
    torch.testing.assert_close(y, ref_fn(x_RD.detach().to(torch.bfloat16), offs_E), rtol=0, atol=0)
