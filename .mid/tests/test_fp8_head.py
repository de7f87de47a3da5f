"""The fused FP8 output head + cross-entropy (fp8/head.py, fp8/kernels/cross_entropy.py).

References: the unfused head (Float8Linear tensorwise, then models.loss.token_cross_entropy) for the same function,
float64 for accuracy (SQNR of both gradients), the PyTorch references of the two kernels for the Triton kernels (in
the CPU interpreter in a child pytest, and on a GPU where there is one).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.interp_child import IN_CHILD, QUANTIZE_INTERPRETER_TRITON, expose_or_run

IGNORE = -100


def _sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp_min(1e-300)))


def _logits_and_targets(M: int, V: int, seed: int = 0, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, V, generator=g) * 3
    logits[1] += 40 * (torch.arange(V) == 7)  # a peaked row: p_target ~ 1 when its target is 7
    targets = torch.randint(0, V, (M,), generator=g)
    targets[1] = 7
    targets[2] = IGNORE
    targets[3] = V - 1  # the last column (masked tail of the last block)
    return logits.to(device=device, dtype=dtype), targets.to(device)


def _fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable fp8 values lie between a and b, elementwise (same format, finite values)."""
    ia, ib = (t.view(torch.int8).to(torch.int32) for t in (a, b))
    # sign-magnitude bytes -> a monotonic integer line
    ia = torch.where(ia < 0, -(ia & 0x7F), ia)
    ib = torch.where(ib < 0, -(ib & 0x7F), ib)
    return (ia - ib).abs()


# ----------------------------------------------------------------------------------------------- in the interpreter

def _kernel_cases():
    # (M, V, dtype); (32, 4096): every tile full at the shipped tiles (the kernels' unmasked EVEN path)
    return [(70, 300, torch.float8_e5m2), (130, 4100, torch.float8_e4m3fn), (5, 17, torch.float8_e5m2),
            (32, 4096, torch.float8_e4m3fn)]


def _check_kernels_against_references(device: str) -> None:
    from fp8 import quant as K
    from fp8 import reference

    for M, V, dt in _kernel_cases():
        logits, targets = _logits_and_targets(M, V, seed=M + V, device=device)
        lse_r, loss_r, gam_r = reference.cross_entropy_fwd_ref(logits, targets, IGNORE)
        from fp8.kernels import cross_entropy as ce

        shipped = ce.CE_FWD_TILE
        try:  # another tile too: several rows per program (a partial last block of rows), several column tiles
            ce.CE_FWD_TILE = (4, 64)
            lse_4, loss_4, gam_4 = K.cross_entropy_fwd(logits, targets, IGNORE, use_triton=True)
        finally:
            ce.CE_FWD_TILE = shipped
        lse_k, loss_k, gam_k = K.cross_entropy_fwd(logits, targets, IGNORE, use_triton=True)
        for got, want in ((lse_4, lse_k), (loss_4, loss_k), (gam_4, gam_k)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        # fp32 sums of up to V terms in another order (per-lane partial sums): relative error up to ~V * 2**-24 in
        # the sum, so ~1e-5 absolute in lse (logits of order 10) and relative in gamax = exp(. - lse)
        torch.testing.assert_close(lse_k, lse_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss_k, loss_r, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gam_k, gam_r, rtol=1e-4, atol=1e-6)
        assert loss_k[2] == 0 and gam_k[2] == 0  # the ignored row
        assert float(gam_k[1]) < 1e-3  # the peaked row: p_target ~ 1, every other p ~ 0
        coef = torch.tensor(0.37 / (M - 1), device=device)
        gamax = gam_r.amax()
        try:  # the transposed copy stored by the kernel (shipped) and by a separate transpose pass: the same bytes
            ce.CE_BWD_FUSED_T = not ce.CE_BWD_FUSED_T
            g_o, gt_o, _ = K.cross_entropy_grad_cast(logits, targets, lse_r, gamax, coef, dt, IGNORE,
                                                     use_triton=True)
        finally:
            ce.CE_BWD_FUSED_T = not ce.CE_BWD_FUSED_T
        g_k, gt_k, s_k = K.cross_entropy_grad_cast(logits, targets, lse_r, gamax, coef, dt, IGNORE, use_triton=True)
        assert torch.equal(g_o.view(torch.int8), g_k.view(torch.int8))
        assert torch.equal(gt_o.view(torch.int8), gt_k.view(torch.int8))
        g_r, _, s_r = reference.cross_entropy_grad_cast_ref(logits, targets, lse_r, gamax, coef, dt, IGNORE)
        assert float(s_k) == float(s_r)
        assert torch.equal(gt_k.view(torch.int8), g_k.t().contiguous().view(torch.int8)), "layouts disagree"
        steps = _fp8_steps_apart(g_k, g_r)
        # exp() of two libraries may differ in the last fp32 bit: at most one fp8 step, on a rare element
        assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 1e-3, (M, V, dt)
        assert int(g_k[2].view(torch.int8).abs().max()) == 0  # ignored row: zeros
        # the gradient's amax maps onto the format's max: the scale comes from the exact amax
        assert float(g_k.float().abs().max()) == torch.finfo(dt).max
    _check_kernel_edge_cases(device)


def _check_kernel_edge_cases(device: str) -> None:
    from fp8 import quant as K
    from fp8 import reference
    from fp8.kernels import cross_entropy as ce

    # A row whose first column tile is all -inf (masked vocabulary padding): exp(-inf - -inf) must not make lse NaN.
    logits, targets = _logits_and_targets(5, 300, seed=11, device=device)
    logits[0, :100] = float("-inf")
    targets[0] = 150
    shipped = ce.CE_FWD_TILE
    try:
        ce.CE_FWD_TILE = (1, 64)
        lse_k, loss_k, gam_k = K.cross_entropy_fwd(logits, targets, IGNORE, use_triton=True)
    finally:
        ce.CE_FWD_TILE = shipped
    lse_r, loss_r, gam_r = reference.cross_entropy_fwd_ref(logits, targets, IGNORE)
    torch.testing.assert_close(lse_k, lse_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_k, loss_r, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gam_k, gam_r, rtol=1e-4, atol=1e-6)
    # No rows, with a vocabulary every tile divides (the unmasked path must not run on an empty tensor).
    empty = torch.empty(0, 2048, dtype=torch.bfloat16, device=device)
    no_targets = torch.empty(0, dtype=torch.long, device=device)
    lse_e, _, _ = K.cross_entropy_fwd(empty, no_targets, IGNORE, use_triton=True)
    g_e, gt_e, _ = K.cross_entropy_grad_cast(empty, no_targets, lse_e, torch.tensor(1.0, device=device),
                                             torch.tensor(1.0, device=device), torch.float8_e4m3fn, IGNORE,
                                             use_triton=True)
    assert lse_e.shape == (0,) and g_e.shape == (0, 2048) and gt_e.shape == (2048, 0)
    with pytest.raises(ValueError, match="empty vocabulary"):
        K.cross_entropy_fwd(torch.empty(4, 0, dtype=torch.bfloat16, device=device),
                            torch.zeros(4, dtype=torch.long, device=device), IGNORE, use_triton=True)


def _interp_kernels_match_references():
    _check_kernels_against_references("cpu")


def _interp_fused_head_through_triton_matches_reference_path(monkeypatch):
    """The head's casts forced through the Triton kernels (the dispatch's policy made to pick them on CPU) against
    the same head on the references."""
    from fp8 import quant
    from fp8.head import Float8LMHead

    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 272, bias=False)
    x = torch.randn(48, 32)
    t = torch.randint(0, 272, (48,))
    results = []
    policy = quant._kernel_for
    for use in (True, False):
        monkeypatch.setattr(quant, "_kernel_for", lambda cast, x, use_triton, use=use: policy(cast, x, use))
        head = Float8LMHead.from_float(copy.deepcopy(lin), "tensorwise")
        xi = x.clone().requires_grad_()
        loss = head(xi, targets=t)
        loss.backward()
        results.append((loss.detach(), xi.grad, head.weight.grad))
    (la, gxa, gwa), (lb, gxb, gwb) = results
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    assert _sqnr_db(gxb, gxa) > 40 and _sqnr_db(gwb, gwa) > 40  # one fp8 step on rare elements at most


# --------------------------------------------------------------------------------------------------------- on CPU

def _heads(V=272, K=64, bias=False, seed=0):
    from fp8.head import Float8LMHead
    from fp8.linear import Float8Linear

    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, V, bias=bias)
    return lin, Float8Linear.from_float(copy.deepcopy(lin), "tensorwise"), Float8LMHead.from_float(copy.deepcopy(lin),
                                                                                                     "tensorwise")


def _fused_vs_unfused(lin, unfused, fused, x, t, min_db: float):
    """Run both heads on (x, t); assert both gradients of the fused one are at least as accurate against float64 as
    the unfused one's (within 0.5 dB) and above min_db. Returns (fused loss, unfused loss, x grad of the fused)."""
    from models.loss import token_cross_entropy

    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_a = token_cross_entropy(unfused(xa)[None], t[None])
    loss_a.backward()
    loss_b = fused(xb, targets=t)
    loss_b.backward()
    x64 = x.double().requires_grad_()
    w64 = lin.weight.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(x64 @ w64.t(), t).backward()
    for got_a, got_b, ref in ((xa.grad, xb.grad, x64.grad), (unfused.weight.grad, fused.weight.grad, w64.grad)):
        sq_a, sq_b = _sqnr_db(ref, got_a), _sqnr_db(ref, got_b)
        assert sq_b > min_db and sq_b >= sq_a - 0.5, (sq_a, sq_b)
    return loss_b.detach(), loss_a.detach(), xb.grad


@pytest.mark.skipif(IN_CHILD, reason="parent-process test")
def test_fused_head_computes_the_unfused_heads_loss_and_gradients():
    """Same loss as Float8Linear + token_cross_entropy (to fp32 rounding), gradients as accurate against float64 (the
    fused g is quantized from fp32 instead of bf16, so never worse), ignored targets, a zero input row."""
    lin, unfused, fused = _heads()
    x = torch.randn(96, 64) * 3
    x[4] = 0
    t = torch.randint(0, 272, (96,))
    t[5] = IGNORE
    loss_b, loss_a, gx = _fused_vs_unfused(lin, unfused, fused, x, t, min_db=25)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(gx).all() and torch.isfinite(fused.weight.grad).all()
    assert torch.equal(fused.fp8_health_stats, unfused.fp8_health_stats) and fused.fp8_health_valid


@pytest.mark.skipif(IN_CHILD, reason="parent-process test")
def test_float32_master_weight_under_autocast_is_cast_as_stored_and_gets_a_float32_gradient():
    """One worker's float32 master weight under bf16 autocast: both heads cast the stored weight to fp8 (no bf16 copy,
    so a dynamic scale from the float32 amax), compute the same loss, and return a float32 weight gradient as accurate
    against float64 as the unfused head's; the fused head's comes out of its GEMM in float32 (no bf16 rounding between)."""
    from models.loss import token_cross_entropy

    lin, unfused, fused = _heads(seed=3)
    x = torch.randn(96, 64) * 3
    t = torch.randint(0, 272, (96,))
    assert fused.weight.dtype == torch.float32
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_a = token_cross_entropy(unfused(xa)[None], t[None])
        loss_b = fused(xb, targets=t)
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_b.float(), loss_a.float(), rtol=1e-6, atol=1e-6)
    assert fused.weight.grad.dtype == unfused.weight.grad.dtype == torch.float32
    assert not torch.equal(fused.weight.grad, fused.weight.grad.bfloat16().float())  # not a bf16 result converted
    x64 = x.bfloat16().double().requires_grad_()
    w64 = lin.weight.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(x64 @ w64.t(), t).backward()
    assert _sqnr_db(w64.grad, fused.weight.grad) >= _sqnr_db(w64.grad, unfused.weight.grad) - 0.5 > 20


@pytest.mark.skipif(IN_CHILD, reason="parent-process test")
def test_fused_head_applies_only_where_it_can_and_says_why_not():
    from fp8 import set_precision

    _, _, fused = _heads()
    assert fused.fuses_loss()
    x, t = torch.randn(8, 64), torch.randint(0, 272, (8,))
    fused.fused_loss = False
    assert not fused.fuses_loss()
    with pytest.raises(ValueError, match="fused_loss=False"):
        fused(x, targets=t)
    fused.fused_loss = True
    set_precision(fused, "bf16")
    assert not fused.fuses_loss()
    torch.testing.assert_close(fused(x), x @ fused.weight.t())  # logits as nn.Linear's
    _, _, rowwise = _heads()
    rowwise.recipe = __import__("fp8").RECIPES["rowwise"]
    assert not rowwise.fuses_loss()
    _, _, pow2 = _heads()
    pow2.recipe = __import__("fp8").Recipe("tensorwise_pow2", "tensorwise", pow2_scales=True, grad_output_e5m2=True,
                                           grad_weight_hp=False)
    assert not pow2.fuses_loss()  # the fused kernels use dynamic, not power-of-two, scales
    _, _, biased = _heads(bias=True)
    assert not biased.fuses_loss()


@pytest.mark.skipif(IN_CHILD, reason="parent-process test")
def test_fused_head_all_targets_ignored_and_bad_targets():
    """Every target ignored: NaN loss and zero gradients, as F.cross_entropy (not NaN gradients, which would poison an
    accumulated step); a target id outside [0, V) that is not ignore_index is refused."""
    _, _, fused = _heads()
    x = torch.randn(8, 64, requires_grad=True)
    t = torch.full((8,), IGNORE)
    loss = fused(x, targets=t)
    loss.backward()
    assert loss.isnan()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(fused.weight.grad, torch.zeros_like(fused.weight))
    for bad in (272, -1):
        t = torch.randint(0, 272, (8,))
        t[3] = bad
        with pytest.raises(RuntimeError, match="outside"):
            fused(torch.randn(8, 64), targets=t)


@pytest.mark.skipif(IN_CHILD, reason="parent-process test")
@pytest.mark.parametrize("fused", [True, False])
def test_model_lm_loss_fuses_the_fp8_head_and_falls_back_with_the_model(fused, monkeypatch):
    """models.loss.model_lm_loss on a converted debug model: the fused head gives the unfused loss and gradients
    (fused or not by the head's setting), and after set_precision("bf16") exactly the bf16 model's loss."""
    import fp8
    import fp8.head
    from fp8.convert import make_module_filter
    from fp8.head import Float8LMHead
    from models.loss import lm_loss, model_lm_loss
    from models.registry import build_model

    torch.manual_seed(0)
    base = build_model("debug_moe", device="cpu")
    base.init_weights(seed=0)
    model = fp8.convert_to_fp8(copy.deepcopy(base), "tensorwise", module_filter=make_module_filter(output_head=True))
    assert isinstance(model.output, Float8LMHead)
    model.output.fused_loss = fused
    tokens = torch.randint(0, base.args.vocab_size, (2, 16))
    targets = torch.randint(0, base.args.vocab_size, (2, 16))
    calls = []
    real = fp8.head.fp8_linear_cross_entropy
    monkeypatch.setattr(fp8.head, "fp8_linear_cross_entropy", lambda *a: calls.append(1) or real(*a))
    loss = model_lm_loss(model, tokens, targets, compiled=False)
    assert len(calls) == (1 if fused else 0)  # the setting decides the path
    loss.backward()
    reference = lm_loss(model(tokens), targets, compiled=False)  # the unfused form, the same converted model
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    # the model's own forward with targets: the same loss whichever form it takes
    torch.testing.assert_close(model(tokens, targets), reference, rtol=1e-5, atol=1e-5)
    head_grad = model.output.weight.grad.clone()
    model.zero_grad()
    reference.backward()
    assert _sqnr_db(model.output.weight.grad, head_grad) > 25
    fp8.set_precision(model, "bf16")
    torch.testing.assert_close(model_lm_loss(model, tokens, targets, compiled=False),
                               lm_loss(base(tokens), targets, compiled=False), rtol=0, atol=0)
    torch.testing.assert_close(model(tokens, targets), lm_loss(base(tokens), targets, compiled=False), rtol=0, atol=0)
    assert torch.equal(base(tokens, targets), lm_loss(base(tokens), targets, compiled=False))  # an nn.Linear head


def _fsdp_rank(rank: int, world: int, init_file: str, result_file: str) -> None:
    import fp8
    from fp8.convert import make_module_filter
    from models.loss import model_lm_loss
    from models.registry import build_model
    from orchestration.training.distributed import parallelize
    from tests.spawned import rank_process_group

    with rank_process_group("gloo", f"file://{init_file}", rank, world):
        torch.manual_seed(0)
        base = build_model("debug_dense", device="cpu", overrides={"n_layers": 2})
        base.init_weights(seed=0)
        ref = fp8.convert_to_fp8(base, "tensorwise", module_filter=make_module_filter(output_head=True))
        sharded = parallelize(copy.deepcopy(ref), world, "fsdp", "float32", "float32")
        # Every rank the same batch: FSDP's averaged gradient is then the one-process gradient.
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, base.args.vocab_size, (2, 16), generator=g)
        targets = torch.randint(0, base.args.vocab_size, (2, 16), generator=g)
        assert ref.output.fuses_loss() and sharded.output.fuses_loss()
        loss_ref = model_lm_loss(ref, tokens, targets, compiled=False)
        loss_ref.backward()
        loss = model_lm_loss(sharded, tokens, targets, compiled=False)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.grad is not None}
        if rank == 0:
            ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            torch.save({"loss": loss.item(), "loss_ref": loss_ref.item(), "keys": sorted(grads) == sorted(ref_grads),
                        "max_rel_err": max(float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max())
                                           for n in ref_grads),
                        "head_grad_norm": float(ref_grads["output.weight"].norm())}, result_file)


@pytest.mark.skipif(IN_CHILD, reason="parent-process test")
@pytest.mark.slow
def test_fused_head_under_fsdp2_on_two_ranks_matches_one_process(tmp_path):
    """The fused FP8 head reached through the model's forward under FSDP2 (gloo, CPU, two ranks): the root unshards
    the head's weight for it, and the loss and every gradient equal the one-process model's."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=2, join=True)
    out = torch.load(tmp_path / "out.pt")
    assert out["keys"] and out["head_grad_norm"] > 0
    assert out["loss"] == pytest.approx(out["loss_ref"], rel=1e-6)
    assert out["max_rel_err"] < 1e-5, out


# --------------------------------------------------------------------------------------------------------- on a GPU

_needs_sm89 = pytest.mark.skipif(
    IN_CHILD or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs an FP8 GPU (sm89+)")


@_needs_sm89
def test_gpu_kernels_match_references():
    _check_kernels_against_references("cuda")


@_needs_sm89
def test_gpu_fused_head_matches_unfused_head_and_float64():
    """16384 tokens x 2048 -> 32768 vocab through torch._scaled_mm: loss equal to the unfused head's to 1e-3, both
    gradients at least as accurate against float64 (minus 0.5 dB)."""

    lin, unfused, fused = _heads(V=32768, K=2048)
    lin, unfused, fused = lin.cuda().bfloat16(), unfused.cuda().bfloat16(), fused.cuda().bfloat16()
    torch.manual_seed(1)
    x = (torch.randn(16384, 2048, device="cuda") * 2).bfloat16()
    t = torch.randint(0, 32768, (16384,), device="cuda")
    t[::97] = IGNORE
    loss_b, loss_a, _ = _fused_vs_unfused(lin, unfused, fused, x, t, min_db=20)
    assert abs(float(loss_b) - float(loss_a)) < 1e-3 * abs(float(loss_a))


def test_ce_head_apply_best_reads_both_backward_forms(tmp_path):
    """benchmarks/ce_head.py's apply_best (train_step.py --ce-config) sets the tiles from a sweep file whose best
    backward stores the transposed copy itself (fused_t=True) and from one where a transpose pass makes it."""
    import json

    from benchmarks.ce_head import apply_best
    from fp8.kernels import cross_entropy as ce

    saved = (ce.CE_FWD_TILE, ce.CE_FWD_WARPS, ce.CE_BWD_TILE, ce.CE_BWD_WARPS, ce.CE_BWD_FUSED_T)
    try:
        for backward, fused_t in (("ours backward fused_t=False tile=(8, 1024) warps=4 off=1e-07 t=True", False),
                                  ("ours backward int8=True tile=(16, 256) warps=4 off=1.7e-07 t=True", True)):
            path = tmp_path / "ce_head.json"
            path.write_text(json.dumps({"best": {"forward": "ours forward tile=(2, 512) warps=8 ok=True",
                                                 "backward": backward}}))
            apply_best(str(path))
            assert (ce.CE_FWD_TILE, ce.CE_FWD_WARPS) == ((2, 512), 8)
            assert ce.CE_BWD_FUSED_T is fused_t
            assert ce.CE_BWD_TILE == ((8, 1024) if not fused_t else (16, 256)) and ce.CE_BWD_WARPS == 4
    finally:
        ce.CE_FWD_TILE, ce.CE_FWD_WARPS, ce.CE_BWD_TILE, ce.CE_BWD_WARPS, ce.CE_BWD_FUSED_T = saved


N_INTERP_CASES = 2
# Triton 3.6's interpreter (the GPU image's) fails on these kernels' loops over a runtime bound ("only 0-dimensional
# arrays can be converted to Python scalars"); 3.8.0 and 3.9.0 run them. On a GPU machine the GPU cases above
# check the same kernels against the references.
expose_or_run(globals(), __file__, N_INTERP_CASES, "test_cross_entropy_kernels_in_subprocess",
              min_triton=QUANTIZE_INTERPRETER_TRITON)
