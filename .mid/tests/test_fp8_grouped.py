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


def run_grouped(x, w, gy, offs, emulate=True, stored_enk=False):
    """stored_enk: the weight is an [E, N, K] parameter passed as its column-major [E, K, N] view (the models'
    layout); its gradient must then come back in the parameter's own layout."""
    xi = x.clone().requires_grad_()
    if stored_enk:
        param = w.transpose(-2, -1).contiguous().requires_grad_()
        wi = param.transpose(-2, -1)
    else:
        param = wi = w.clone().requires_grad_()
    op = Fp8GroupedMM(emulate=emulate)
    out = op(xi, wi, offs)
    out.backward(gy)
    gw = param.grad.transpose(-2, -1) if stored_enk else param.grad
    if stored_enk:
        assert param.grad.is_contiguous()
    return out, xi.grad, gw, op


def test_grouped_equals_per_group_dense_fp8():
    """Every group's output is exactly the dense rowwise FP8 linear on its rows, and its weight gradient the dense
    high-precision one (rowwise_gw_hp's); an empty expert gets a zero weight gradient, no NaN."""
    x, w, gy, offs = make()
    out, _, gw, _ = run_grouped(x, w, gy, offs)
    bounds = [0, *offs.tolist()]
    backend = get_backend("cpu")
    for e in range(E):
        s, t = bounds[e], bounds[e + 1]
        if s == t:
            assert (gw[e] == 0).all()
            continue
        xe = x[s:t].clone().requires_grad_()
        we_NK = w[e].t().contiguous().requires_grad_()
        ye, _ = _Fp8LinearFn.apply(xe, we_NK, RECIPES["rowwise_gw_hp"], backend, False)
        ye.backward(gy[s:t])
        torch.testing.assert_close(out[s:t], ye, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw[e], we_NK.grad.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stored_enk", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sqnr_vs_float64(dtype, stored_enk):
    x, w, gy, offs = make(dtype, seed=1)
    out, gx, gw, op = run_grouped(x, w, gy, offs, stored_enk=stored_enk)
    assert out.dtype == dtype and gw.dtype == dtype
    bounds = [0, *offs.tolist()]
    x64, w64, g64 = x.double(), w.double(), gy.double()
    ref_out = torch.cat([x64[s:t] @ w64[e] for e, (s, t) in enumerate(itertools.pairwise(bounds))])
    ref_gx = torch.cat([g64[s:t] @ w64[e].t() for e, (s, t) in enumerate(itertools.pairwise(bounds))])
    ref_gw = torch.stack([x64[s:t].t() @ g64[s:t] for s, t in itertools.pairwise(bounds)])
    assert sqnr(out, ref_out) > 25 and sqnr(gx, ref_gx) > 25 and sqnr(gw, ref_gw) > 25
    # the weight gradient never went through fp8: the activations' own precision
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
    assert b.dim() == 3  # 2D x 3D: per-row scale_a [M], per-expert scale_b [E, N]
    assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
    out = torch.zeros(a.shape[0], b.shape[2])
    for e, (s, t) in enumerate(zip(starts, ends)):
        out[s:t] = (a[s:t].float() * scale_a[s:t, None]) @ (b[e].float() * scale_b[e][None, :])
    return out.to(out_dtype)


@pytest.mark.parametrize("stored_enk", [False, True])
def test_gpu_path_plumbing_matches_emulation(monkeypatch, stored_enk):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm, raising=False)
    x, w, gy, offs = make(torch.bfloat16, seed=2)
    emu = run_grouped(x, w, gy, offs, emulate=True, stored_enk=stored_enk)[:3]
    real = run_grouped(x, w, gy, offs, emulate=False, stored_enk=stored_enk)[:3]
    for a, b in zip(emu, real):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_offsets_must_be_int32():
    x, w, _, offs = make()
    with pytest.raises(ValueError, match="int32"):
        Fp8GroupedMM()(x, w, offs.long())


def _run_mode(mode, stored_enk, compiled=False):
    x, w, gy, offs = make(torch.bfloat16, seed=5)
    xi = x.clone().requires_grad_()
    param = (w.transpose(-2, -1).contiguous() if stored_enk else w.clone()).requires_grad_()
    op = Fp8GroupedMM(emulate=True, mode=mode)

    def f(x_, p_, offs_):
        return op(x_, p_.transpose(-2, -1) if stored_enk else p_, offs_) * 2.0

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    out = fn(xi, param, offs)
    out.backward(gy)
    return out.detach(), xi.grad, param.grad


@pytest.mark.parametrize("stored_enk", [False, True])
def test_opaque_custom_ops_equal_the_autograd_function(stored_enk):
    """The default form (two custom ops, what compiled MoE blocks run) computes exactly what the autograd.Function
    computes, eagerly and under torch.compile in one graph (fullgraph=True fails on any graph break)."""
    want = _run_mode("eager", stored_enk)
    for compiled in (False, True):
        torch._dynamo.reset()
        got = _run_mode("opaque", stored_enk, compiled=compiled)
        for g, w_ in zip(got, want, strict=True):
            assert g.shape == w_.shape and g.stride() == w_.stride()
            assert torch.equal(g, w_), (compiled, (g.float() - w_.float()).abs().max().item())


def test_grouped_mode_is_validated():
    with pytest.raises(ValueError, match="mode"):
        Fp8GroupedMM(mode="fused")


def test_op_bodies_trace_without_graph_breaks(monkeypatch):
    """The bodies fp8.grouped compiles on CUDA (body mode "compiled") trace as one graph each, forward and backward,
    and the traced bodies compute what the eager ones do. On CPU the emulated GEMM is kept out
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
    bwd = torch.compile(g._grouped_backward, backend="eager", fullgraph=True, dynamic=False)
    grads = {}
    for keep_fp8 in (True, False):  # the forward keeps the fp8 weight, or the weight for a recast in backward
        out, stats, sw, q = fwd(x, w, offs, e4m3, False, keep_fp8)
        out_ref, stats_ref, sw_ref, q_ref = g._grouped_forward(x, w, offs, e4m3, False, keep_fp8)
        assert torch.equal(out, out_ref) and torch.equal(stats, stats_ref) and torch.equal(sw, sw_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and q.numel() == (w.numel() if keep_fp8 else 0)
        kept = q if keep_fp8 else w
        gx, gw = bwd(gy, kept, offs, x, sw, keep_fp8, True, torch.float32, e4m3, False)
        gx_ref, gw_ref = g._grouped_backward(gy, kept, offs, x, sw, keep_fp8, True, torch.float32, e4m3, False)
        assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref) and gw.dtype == torch.float32
        grads[keep_fp8] = (gx, gw)
    # the recast by the saved scales gives the forward's fp8 bytes: the same gradients either way
    assert torch.equal(grads[True][0], grads[False][0]) and torch.equal(grads[True][1], grads[False][1])


def test_body_mode_switch_and_compile_blocks_sets_it():
    """Bodies compile by default; the worker's compile_blocks picks eager bodies for every CUDA-graph mode (compiled
    bodies break CUDA-graph trees' step tracking), undoes only its own setting afterwards (an explicit choice survives
    a default-mode compile), and bad values fail."""
    pytest.importorskip("omegaconf")  # orchestration.training.compile's config; absent on the GPU image
    from fp8 import grouped
    from orchestration.training.compile import compile_blocks

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict()

    try:
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
        assert grouped.body_mode() == "compiled"
        with pytest.raises(ValueError, match="body mode"):
            grouped.set_body_mode("fast")
    finally:
        grouped.set_body_mode(None)


@pytest.mark.parametrize("stored_enk", [True, False])
def test_dgrad_is_the_fp8_dgrad_on_the_forwards_quantized_weight(stored_enk):
    """The grad-input GEMM runs on the weight exactly as forward quantized it (its row scales folded into gy's
    columns), so gx equals a float64 product of the dequantized forward weight and the quantized (gy / sw) to float32
    rounding, and stays accurate against float64; the custom ops and the autograd.Function give the same bits; a
    padding tail past offs[-1] stays out of it."""
    from fp8 import quant

    E, K, N, M = 4, 64, 96, 144  # 16 rows past offs[-1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(M, K, generator=gen)
    x[-16:] = 0
    storage = torch.randn(E, N, K, generator=gen) * torch.logspace(-1, 1, N)[None, :, None]  # rows of varied scale
    gy = torch.randn(M, N, generator=gen) * 3
    offs = torch.tensor([40, 56, 96, 128], dtype=torch.int32)
    results = {}
    for mode in ("opaque", "eager"):
        # stored [E, N, K] (nn.Linear's layout, passed as its column-major [E, K, N] view) or [E, K, N] row-major
        leaf = (storage.clone() if stored_enk else storage.transpose(-2, -1).contiguous()).requires_grad_()
        w_EKN = leaf.transpose(-2, -1) if stored_enk else leaf
        xi = x.clone().requires_grad_()
        out = Fp8GroupedMM(emulate=True, mode=mode)(xi, w_EKN, offs)
        out.backward(gy)
        results[mode] = (out.detach(), xi.grad.clone(), leaf.grad.clone())
    for got, want in zip(results["opaque"], results["eager"], strict=True):
        assert torch.equal(got[:128], want[:128])  # rows past offs[-1]: unspecified
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
    gx = results["opaque"][1]
    torch.testing.assert_close(gx[:128].double(), expect[:128], rtol=1e-5, atol=1e-5)
    ref = torch.zeros(M, K, dtype=torch.float64)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        ref[lo:hi] = gy[lo:hi].double() @ w_EKN[e].double().t()
        lo = hi
    assert sqnr(gx[:128], ref[:128]) > 25


def test_float32_master_weights_are_cast_to_fp8_as_stored_under_autocast():
    """Under bf16 autocast with float32 expert weights (one worker's master weights), only the tokens take bf16: the
    forward quantizes the float32 storage itself (no bf16 copy of the weight, so no double rounding: the fp8 bytes
    differ from those of the bf16-rounded weight), the grad-input GEMM reads those same bytes transposed, and the
    weight gradient comes back float32 in the parameter's layout, equal to the bf16 weight-gradient GEMM's."""
    import fp8.grouped as g
    from fp8 import reference

    E, K, N, M = 4, 64, 96, 128
    gen = torch.Generator().manual_seed(7)
    storage = torch.randn(E, N, K, generator=gen) / K**0.5  # [E, N, K] float32, the models' layout
    x = torch.randn(M, K, generator=gen)
    gy = torch.randn(M, N, generator=gen)
    offs = torch.tensor([32, 64, 96, 128], dtype=torch.int32)
    e4m3 = torch.float8_e4m3fn
    rows_fp8, _ = reference.quantize_rowwise_ref(storage.reshape(E * N, K), e4m3)
    rows_fp8_of_bf16, _ = reference.quantize_rowwise_ref(storage.bfloat16().reshape(E * N, K), e4m3)
    assert not torch.equal(rows_fp8.view(torch.uint8), rows_fp8_of_bf16.view(torch.uint8))  # the test can tell

    _, _, _, q_EKN = g._grouped_forward(x.bfloat16(), storage.transpose(-2, -1), offs, e4m3, False, True)
    want_q = rows_fp8.reshape(E, N, K).transpose(-2, -1).contiguous()
    assert q_EKN.is_contiguous() and torch.equal(q_EKN.view(torch.uint8), want_q.view(torch.uint8))

    leaf = storage.clone().requires_grad_()
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Fp8GroupedMM(emulate=True)(xi, leaf.transpose(-2, -1), offs)
    assert out.dtype == torch.bfloat16
    out.backward(gy.bfloat16())
    assert leaf.grad.dtype == torch.float32 and leaf.grad.is_contiguous()
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        # gw^T = gy^T x in the activations' precision (bf16 operands, float32 accumulation), then float32
        want_gw = (gy[lo:hi].bfloat16().double().t() @ x[lo:hi].bfloat16().double()).float()
        torch.testing.assert_close(leaf.grad[e], want_gw, rtol=1e-5, atol=1e-5)
        lo = hi


@pytest.mark.parametrize("mode", ["opaque", "eager"])
def test_backward_keeps_the_fp8_weight_only_for_weights_wider_than_the_tokens(mode):
    """What autograd keeps of an expert weight for backward: float32 master weights under bf16 autocast keep their fp8
    form (1 byte a weight) and no bf16 copy; a weight already in the tokens' dtype (FSDP2's bf16 gather, which FSDP2
    frees after the forward and gathers again) keeps only the weight itself, no weight-sized copy."""
    E, K, N, M = 4, 64, 96, 128
    offs = torch.tensor([32, 64, 96, 128], dtype=torch.int32)
    for weight_dtype in (torch.float32, torch.bfloat16):
        param = torch.randn(E, N, K, dtype=weight_dtype, requires_grad=True)
        x = torch.randn(M, K, requires_grad=True)
        saved = []
        with (torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t),
              torch.autocast("cpu", dtype=torch.bfloat16)):
            Fp8GroupedMM(emulate=True, mode=mode)(x, param.transpose(-2, -1), offs).sum().backward()
        weight_sized = [t for t in saved if t.numel() == param.numel()]
        if weight_dtype == torch.float32:
            assert [(t.dtype, tuple(t.shape)) for t in weight_sized] == [(torch.float8_e4m3fn, (E, K, N))], mode
        else:
            assert len(weight_sized) == 1 and weight_sized[0].untyped_storage().data_ptr() == \
                param.untyped_storage().data_ptr(), mode
