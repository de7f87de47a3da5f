"""FP8 grouped GEMM (MoE experts): equals the per-group dense FP8 path, SQNR vs float64, GPU-path plumbing.

torch._scaled_grouped_mm does not run on CPU, so the GPU path is exercised against a stand-in that
enforces its layout and scale-shape contract (row-major A, column-major B, 1D/2D float32 scales) and
computes the dequantized product; the emulated path must agree with it.
"""

import itertools

import pytest
import torch

from fp8 import Fp8GroupedMM
from fp8.backend import get_backend
from fp8.linear import _Fp8LinearFn
from fp8.recipes import RECIPES
from tests.numerics import sqnr

M, K, N, E = 96, 64, 48, 4


def make(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, :3] *= 30.0
    x[:8] = 0.0
    w = torch.randn(E, K, N, generator=g) / K**0.5
    gy = torch.randn(M, N, generator=g)
    offs = torch.tensor([32, 32, 80, 96], dtype=torch.int32)  # group 1 is empty
    return x.to(dtype), w.to(dtype), gy.to(dtype), offs


def run_grouped(x, w, gy, offs, emulate=True, wgrad_scaling="global", stored_enk=False):
    """stored_enk: the weight is an [E, N, K] parameter passed as its column-major [E, K, N] view (the models'
    layout); its gradient must then come back in the parameter's own layout."""
    xi = x.clone().requires_grad_()
    if stored_enk:
        param = w.transpose(-2, -1).contiguous().requires_grad_()
        wi = param.transpose(-2, -1)
    else:
        param = wi = w.clone().requires_grad_()
    # dgrad="fp8": these tests check the fp8 grad-input GEMM with promoted accumulation (the emulated path computes
    # the same function for "fp8_fast"; only the GPU kernel's accumulation differs, tests/test_fp8_gpu.py).
    op = Fp8GroupedMM(emulate=emulate, wgrad_scaling=wgrad_scaling, dgrad="fp8")
    out = op(xi, wi, offs)
    out.backward(gy)
    gw = param.grad.transpose(-2, -1) if stored_enk else param.grad
    if stored_enk:
        assert param.grad.is_contiguous()
    return out, xi.grad, gw, op


def test_grouped_equals_per_group_dense_fp8():
    """per_expert wgrad scaling: every group is exactly the dense rowwise FP8 linear on its rows."""
    x, w, gy, offs = make()
    out, gx, gw, _ = run_grouped(x, w, gy, offs, wgrad_scaling="per_expert")
    bounds = [0, *offs.tolist()]
    backend = get_backend("cpu")
    for e in range(E):
        s, t = bounds[e], bounds[e + 1]
        if s == t:
            assert (gw[e] == 0).all()  # empty expert: zero weight gradient, no NaN
            continue
        xe = x[s:t].clone().requires_grad_()
        we_NK = w[e].t().contiguous().requires_grad_()
        ye, _ = _Fp8LinearFn.apply(xe, we_NK, RECIPES["rowwise"], backend, False)
        ye.backward(gy[s:t])
        torch.testing.assert_close(out[s:t], ye, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx[s:t], xe.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw[e], we_NK.grad.t(), rtol=1e-5, atol=1e-5)


def test_global_wgrad_scaling_uses_one_column_scale_over_all_groups():
    """global wgrad scaling: out and grad_input as per_expert; grad_weight from x and gy quantized per column over
    all rows (recipes.quantize_rowwise_and_colwise_ref's column-scaled copies), contracted group by group."""
    from fp8.recipes import quantize_rowwise_and_colwise_ref

    x, w, gy, offs = make(seed=3)
    x[80:] /= 64.0  # the last group's activations are 64x smaller: its own column scales would be 64x larger
    out_g, gx_g, gw_g, _ = run_grouped(x, w, gy, offs, wgrad_scaling="global")
    out_p, gx_p, gw_p, _ = run_grouped(x, w, gy, offs, wgrad_scaling="per_expert")
    torch.testing.assert_close(out_g, out_p, rtol=0, atol=0)
    torch.testing.assert_close(gx_g, gx_p, rtol=0, atol=0)
    e4m3 = get_backend("cpu").e4m3
    _, _, x_t_KM, sx_1K = quantize_rowwise_and_colwise_ref(x, e4m3, True)
    _, _, g_t_NM, sg_1N = quantize_rowwise_and_colwise_ref(gy, e4m3, True)
    x_deq, g_deq = x_t_KM.float().t() / sx_1K, g_t_NM.float().t() / sg_1N
    bounds = [0, *offs.tolist()]
    want = torch.stack([x_deq[s:t].t() @ g_deq[s:t] for s, t in itertools.pairwise(bounds)])
    torch.testing.assert_close(gw_g, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(gw_g[3], gw_p[3]) and torch.equal(gw_g[0], gw_p[0])  # group 0: same pow2 scales


@pytest.mark.parametrize("stored_enk", [False, True])
@pytest.mark.parametrize("wgrad_scaling", ["global", "per_expert", "hp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sqnr_vs_float64(dtype, wgrad_scaling, stored_enk):
    x, w, gy, offs = make(dtype, seed=1)
    out, gx, gw, op = run_grouped(x, w, gy, offs, wgrad_scaling=wgrad_scaling, stored_enk=stored_enk)
    assert out.dtype == dtype and gw.dtype == dtype
    bounds = [0, *offs.tolist()]
    x64, w64, g64 = x.double(), w.double(), gy.double()
    ref_out = torch.cat([x64[s:t] @ w64[e] for e, (s, t) in enumerate(itertools.pairwise(bounds))])
    ref_gx = torch.cat([g64[s:t] @ w64[e].t() for e, (s, t) in enumerate(itertools.pairwise(bounds))])
    ref_gw = torch.stack([x64[s:t].t() @ g64[s:t] for s, t in itertools.pairwise(bounds)])
    assert sqnr(out, ref_out) > 25 and sqnr(gx, ref_gx) > 25 and sqnr(gw, ref_gw) > 25
    if wgrad_scaling == "hp":  # the weight gradient never went through fp8: the activations' own precision
        assert sqnr(gw, ref_gw) > (45 if dtype == torch.bfloat16 else 100)
    assert (out[:8] == 0).all()
    assert op.last_stats is not None and torch.isfinite(op.last_stats).all()


def fake_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=None, use_fast_accum=False):
    """CPU stand-in with torch's CUDA contract (see torch/_meta_registrations.py _meta_grouped_mm_common)."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert a.stride(-1) == 1 and a.stride(-2) > 1, "mat_a must be row-major"
    assert b.stride(-2) == 1 and b.stride(-1) > 1, "mat_b must be column-major"
    assert scale_a.dtype == scale_b.dtype == torch.float32 and out_dtype == torch.bfloat16
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # 2D x 3D: per-row scale_a [M], per-expert scale_b [E, N]
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        out = torch.zeros(a.shape[0], b.shape[2])
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = (a[s:t].float() * scale_a[s:t, None]) @ (b[e].float() * scale_b[e][None, :])
        return out.to(out_dtype)
    # 2D x 2D grouped along the contraction dim: scale_a [E*rows_a], scale_b [E*cols_b]
    g = offs.shape[0]
    assert scale_a.shape == (g * a.shape[0],) and scale_b.shape == (g * b.shape[1],)
    sa, sb = scale_a.view(g, -1), scale_b.view(g, -1)
    out = torch.zeros(g, a.shape[0], b.shape[1])
    for e, (s, t) in enumerate(zip(starts, ends)):
        out[e] = (a[:, s:t].float() * sa[e][:, None]) @ (b[s:t].float() * sb[e][None, :])
    return out.to(out_dtype)


@pytest.mark.parametrize("stored_enk", [False, True])
@pytest.mark.parametrize("wgrad_scaling", ["global", "per_expert", "hp"])
def test_gpu_path_plumbing_matches_emulation(monkeypatch, wgrad_scaling, stored_enk):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm, raising=False)
    x, w, gy, offs = make(torch.bfloat16, seed=2)
    kw = {"wgrad_scaling": wgrad_scaling, "stored_enk": stored_enk}
    emu = run_grouped(x, w, gy, offs, emulate=True, **kw)[:3]
    real = run_grouped(x, w, gy, offs, emulate=False, **kw)[:3]
    for a, b in zip(emu, real):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_unknown_wgrad_scaling_is_rejected():
    with pytest.raises(ValueError, match="wgrad_scaling"):
        Fp8GroupedMM(wgrad_scaling="tensorwise")


def test_offsets_must_be_int32():
    x, w, _, offs = make()
    with pytest.raises(ValueError, match="int32"):
        Fp8GroupedMM()(x, w, offs.long())


def _run_mode(mode, wgrad_scaling, stored_enk, compiled=False):
    x, w, gy, offs = make(torch.bfloat16, seed=5)
    xi = x.clone().requires_grad_()
    param = (w.transpose(-2, -1).contiguous() if stored_enk else w.clone()).requires_grad_()
    op = Fp8GroupedMM(emulate=True, wgrad_scaling=wgrad_scaling, mode=mode, dgrad="fp8")

    def f(x_, p_, offs_):
        return op(x_, p_.transpose(-2, -1) if stored_enk else p_, offs_) * 2.0

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    out = fn(xi, param, offs)
    out.backward(gy)
    return out.detach(), xi.grad, param.grad


@pytest.mark.parametrize("stored_enk", [False, True])
@pytest.mark.parametrize("wgrad_scaling", ["global", "per_expert", "hp"])
def test_opaque_custom_ops_equal_the_autograd_function(wgrad_scaling, stored_enk):
    """The default form (two custom ops, what compiled MoE blocks run) computes exactly what the autograd.Function
    computes, eagerly and under torch.compile in one graph (fullgraph=True fails on any graph break)."""
    want = _run_mode("eager", wgrad_scaling, stored_enk)
    for compiled in (False, True):
        torch._dynamo.reset()
        got = _run_mode("opaque", wgrad_scaling, stored_enk, compiled=compiled)
        for g, w_ in zip(got, want, strict=True):
            assert g.shape == w_.shape and g.stride() == w_.stride()
            assert torch.equal(g, w_), (compiled, (g.float() - w_.float()).abs().max().item())


def test_grouped_mode_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="mode"):
        Fp8GroupedMM(mode="fused")
    monkeypatch.setenv("FP8_GROUPED_MODE", "bogus")
    x, w, _, offs = make()
    with pytest.raises(ValueError, match="FP8_GROUPED_MODE"):
        Fp8GroupedMM()(x, w, offs)


@pytest.mark.parametrize("stored_enk", [False, True])
def test_hp_dgrad_gives_the_high_precision_grad_input(stored_enk):
    """dgrad="hp": gx is the bf16 grouped GEMM of gy and w (exactly the per-group bf16 product), the output and the
    weight gradient are unchanged; "width" picks hp only for widths that are not multiples of 256, "auto" is fp8 on the
    forward's quantized weight everywhere with power-of-two scales, fp8 with fast accumulation without."""
    x, w, gy, offs = make(torch.bfloat16, seed=7)
    outs = {}
    for dgrad in ("fp8", "hp"):
        xi = x.clone().requires_grad_()
        param = (w.transpose(-2, -1).contiguous() if stored_enk else w.clone()).requires_grad_()
        op = Fp8GroupedMM(emulate=True, dgrad=dgrad)
        out = op(xi, param.transpose(-2, -1) if stored_enk else param, offs)
        out.backward(gy)
        outs[dgrad] = (out.detach(), xi.grad, param.grad)
    assert torch.equal(outs["hp"][0], outs["fp8"][0]) and torch.equal(outs["hp"][2], outs["fp8"][2])
    gx_ref = torch.zeros_like(x, dtype=torch.float32)
    start = 0
    for e, end in enumerate(offs.tolist()):
        gx_ref[start:end] = gy[start:end].float() @ w[e].float().t()
        start = end
    err_hp = (outs["hp"][1].float() - gx_ref).norm() / gx_ref.norm()
    err_fp8 = (outs["fp8"][1].float() - gx_ref).norm() / gx_ref.norm()
    assert err_hp < 1e-2 < err_fp8 * 2, (err_hp.item(), err_fp8.item())
    assert err_hp < err_fp8 / 4
    op = Fp8GroupedMM(emulate=True)
    assert op.dgrad == "auto"
    assert [op.dgrad_for(torch.empty(4, k, 8)) for k in (2048, 1408)] == ["fp8_reuse", "fp8_reuse"]
    not_pow2 = Fp8GroupedMM(emulate=True, pow2=False)
    assert [not_pow2.dgrad_for(torch.empty(4, k, 8)) for k in (2048, 1408)] == ["fp8_fast", "fp8_fast"]
    width = Fp8GroupedMM(emulate=True, dgrad="width")
    assert not width.hp_dgrad(torch.empty(4, 2048, 8)) and width.hp_dgrad(torch.empty(4, 1408, 8))
    assert [width.dgrad_for(torch.empty(4, k, 8)) for k in (2048, 1408)] == ["fp8", "hp"]
    with pytest.raises(ValueError, match="dgrad"):
        Fp8GroupedMM(dgrad="fp16")


@pytest.mark.parametrize("wgrad", ["hp", "global", "per_expert"])
def test_op_bodies_trace_without_graph_breaks(monkeypatch, wgrad):
    """The bodies fp8.grouped compiles on CUDA (FP8_GROUPED_BODY=compiled) trace as one graph each, forward and both
    grad-input choices, and the traced bodies compute what the eager ones do. On CPU the emulated GEMM is kept out
    of compiled graphs (torch.compiler.disable), so it is swapped here for a traceable bf16 stand-in on both sides."""
    import fp8.grouped as g

    monkeypatch.setattr(g, "_grouped_emulated",
                        lambda a, b, offs: torch._grouped_mm(a.to(torch.bfloat16), b.to(torch.bfloat16), offs).float())
    torch._dynamo.reset()
    E, K, N, M = 4, 64, 96, 128
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    w = torch.randn(E, N, K, generator=gen).to(torch.bfloat16).transpose(-2, -1)
    gy = torch.randn(M, N, generator=gen).to(torch.bfloat16)
    offs = torch.tensor([32, 64, 96, 128], dtype=torch.int32)
    e4m3 = torch.float8_e4m3fn
    fwd = torch.compile(g._grouped_forward, backend="eager", fullgraph=True, dynamic=False)
    out, stats, saved, sw, q = fwd(x, w, offs, e4m3, False, True, wgrad, "fp8_keep")
    out_ref, stats_ref, _, sw_ref, q_ref = g._grouped_forward(x, w, offs, e4m3, False, True, wgrad, "fp8_keep")
    assert torch.equal(out, out_ref) and torch.equal(stats, stats_ref) and torch.equal(sw, sw_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and q.shape == (E, K, N)
    bwd = torch.compile(g._grouped_backward, backend="eager", fullgraph=True, dynamic=False)
    for dgrad in ("fp8", "fp8_fast", "hp", "fp8_reuse", "fp8_keep"):
        gx, gw = bwd(gy, w, offs, saved, e4m3, False, True, wgrad, dgrad, sw, q if dgrad == "fp8_keep" else None)
        gx_ref, gw_ref = g._grouped_backward(gy, w, offs, saved, e4m3, False, True, wgrad, dgrad, sw,
                                             q_ref if dgrad == "fp8_keep" else None)
        assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref), (wgrad, dgrad)


def test_body_mode_switch_overrides_env_and_compile_blocks_sets_it(monkeypatch):
    """set_body_mode beats FP8_GROUPED_BODY; the worker's compile_blocks picks eager bodies for every CUDA-graph mode
    (compiled bodies break CUDA-graph trees' step tracking), undoes only its own setting afterwards (an explicit
    choice survives a default-mode compile), and bad values fail."""
    pytest.importorskip("omegaconf")  # orchestration.training.loop's config; absent on the GPU image
    from fp8 import grouped
    from orchestration.training.loop import compile_blocks

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict()

    try:
        monkeypatch.setenv("FP8_GROUPED_BODY", "compiled")
        assert grouped.body_mode() == "compiled"
        for graphed in ("reduce-overhead", "max-autotune"):
            compile_blocks(Blocks(), graphed)
            assert grouped.body_mode() == "eager", graphed
            compile_blocks(Blocks(), "default")
            assert grouped.body_mode() == "compiled", graphed
        compile_blocks(Blocks(), "max-autotune-no-cudagraphs")
        assert grouped.body_mode() == "compiled"
        grouped.set_body_mode("eager")  # the user's own choice
        compile_blocks(Blocks(), "default")
        assert grouped.body_mode() == "eager"
        grouped.set_body_mode(None)
        monkeypatch.setenv("FP8_GROUPED_BODY", "eager")
        assert grouped.body_mode() == "eager"
        grouped.set_body_mode("compiled")
        assert grouped.body_mode() == "compiled"
        with pytest.raises(ValueError, match="body mode"):
            grouped.set_body_mode("fast")
        grouped.set_body_mode(None)
        monkeypatch.setenv("FP8_GROUPED_BODY", "fast")
        with pytest.raises(ValueError, match="FP8_GROUPED_BODY"):
            grouped.body_mode()
    finally:
        grouped.set_body_mode(None)


def _no_recast(*args, **kwargs):
    raise AssertionError("fp8_keep recast the weight in backward instead of using the forward's copy")


@pytest.mark.parametrize("wgrad", ["hp", "global", "per_expert"])
@pytest.mark.parametrize("stored_enk", [True, False])
def test_reuse_dgrad_is_the_fp8_dgrad_on_the_forwards_quantized_weight(stored_enk, wgrad, monkeypatch):
    """dgrad="fp8_reuse": gx is computed from the weight exactly as forward quantized it (its row scales folded into
    gy's columns), so gx equals a float64 product of the dequantized forward weight and the quantized (gy / sw) to
    float32 rounding; its accuracy against float64 matches the two-pass column-cast dgrad's (within 0.5 dB); output and
    weight gradient are unchanged; a padding tail past offs[-1] stays out of it."""
    from fp8 import quant

    E, K, N, M = 4, 64, 96, 144  # 16 rows past offs[-1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(M, K, generator=gen)
    x[-16:] = 0
    storage = torch.randn(E, N, K, generator=gen) * torch.logspace(-1, 1, N)[None, :, None]  # rows of varied scale
    gy = torch.randn(M, N, generator=gen) * 3
    offs = torch.tensor([40, 56, 96, 128], dtype=torch.int32)
    results = {}
    # fp8_keep (the forward's cast writes the grad-input layout too and keeps it) through the custom ops and through
    # the autograd.Function (mode "eager"): the same bytes as fp8_reuse's recast, so the same gradients bit for bit.
    for dgrad, mode in (("fp8", None), ("fp8_reuse", None), ("fp8_keep", "opaque"), ("fp8_keep", "eager")):
        # stored [E, N, K] (nn.Linear's layout, passed as its column-major [E, K, N] view) or [E, K, N] row-major
        leaf = (storage.clone() if stored_enk else storage.transpose(-2, -1).contiguous()).requires_grad_()
        w_EKN = leaf.transpose(-2, -1) if stored_enk else leaf
        xi = x.clone().requires_grad_()
        op = Fp8GroupedMM(emulate=True, dgrad=dgrad, wgrad_scaling=wgrad, mode=mode)
        with monkeypatch.context() as m:
            if dgrad == "fp8_keep":  # the kept copy must serve backward: a recast would mean it was dropped
                m.setattr(quant, "cast_rows_transposed_batched", _no_recast)
            out = op(xi, w_EKN, offs)
            out.backward(gy)
        results[dgrad if mode is None else f"{dgrad}:{mode}"] = (out.detach(), xi.grad.clone(), leaf.grad.clone())
    assert torch.equal(results["fp8"][0][:128], results["fp8_reuse"][0][:128])  # rows past offs[-1]: unspecified
    assert torch.equal(results["fp8"][2], results["fp8_reuse"][2])
    for keep in ("fp8_keep:opaque", "fp8_keep:eager"):
        out_k, gx_k, gw_k = results[keep]
        assert torch.equal(out_k[:128], results["fp8_reuse"][0][:128]), keep
        assert torch.equal(gx_k[:128], results["fp8_reuse"][1][:128]), keep
        assert torch.equal(gw_k, results["fp8_reuse"][2]), keep
    w_EKN = storage.transpose(-2, -1)
    q, sw_E1N = quant.quantize_colwise_3d(w_EKN, torch.float8_e4m3fn, True)  # forward's quantization
    sw_EN = sw_E1N.reshape(E, N)
    gid = torch.searchsorted(offs, torch.arange(M, dtype=torch.int32), right=True).clamp(max=E)
    inv = torch.cat([sw_EN.reciprocal(), torch.zeros(1, N)])
    g8, sg = quant.quantize_rowwise(gy * inv[gid], torch.float8_e4m3fn, -1, True)
    expect = torch.zeros(M, K, dtype=torch.float64)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        a = g8[lo:hi].double() / sg[lo:hi].double()
        expect[lo:hi] = a @ q[e].double().t()
        lo = hi
    gx_reuse = results["fp8_reuse"][1]
    torch.testing.assert_close(gx_reuse[:128].double(), expect[:128], rtol=1e-5, atol=1e-5)
    ref = torch.zeros(M, K, dtype=torch.float64)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        ref[lo:hi] = gy[lo:hi].double() @ w_EKN[e].double().t()
        lo = hi

    def sqnr(a):
        return float(10 * torch.log10(ref[:128].pow(2).sum() / (a[:128].double() - ref[:128]).pow(2).sum()))

    assert sqnr(gx_reuse) > 25 and sqnr(gx_reuse) >= sqnr(results["fp8"][1]) - 0.5, (sqnr(gx_reuse),
                                                                                       sqnr(results["fp8"][1]))
