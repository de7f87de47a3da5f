"""Float8Linear numerics: SQNR of output and both gradients vs float64, per recipe, dtype and path.

Inputs have outlier channels and all-zero rows. The emulated path must equal the torch._scaled_mm path (on a GPU
when there is one, else on CPU, where torch implements _scaled_mm too), and the quantization math must stay finite on
zeros and tiny values. Thresholds sit a few dB under measured values (fp8 e4m3 is ~28-30 dB on Gaussian data).
"""

import pytest
import torch

from fp8 import RECIPES, Float8Linear
from fp8.linear import scaled_mm
from fp8.reference import (
    amax_to_scale,
    quantize_rowwise_and_colwise_ref,
    quantize_rowwise_ref,
    quantize_tensorwise_ref,
    saturated_cast,
)
from tests.numerics import sqnr

M, K, N = 64, 128, 96


def make_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, :4] *= 40.0  # outlier channels
    x[:3] = 0.0  # all-zero rows
    w = torch.randn(N, K, generator=g) / K**0.5
    gy = torch.randn(M, N, generator=g)
    gy[5] = 0.0
    return x.to(dtype), w.to(dtype), gy.to(dtype)


def run_fp8(recipe, x, w, gy, emulate):
    lin = torch.nn.Linear(K, N, bias=False, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        lin.weight.copy_(w)
    mod = Float8Linear.from_float(lin, recipe)
    mod.emulate = emulate
    xi = x.clone().requires_grad_()
    y = mod(xi)
    y.backward(gy)
    return y, xi.grad, lin.weight.grad, mod


def reference(x, w, gy):
    x64, w64, gy64 = x.double(), w.double(), gy.double()
    return x64 @ w64.t(), gy64 @ w64, gy64.t() @ x64


# Minimum SQNR (dB) of (y, grad_x, grad_w); tensorwise grads use e5m2 (2 mantissa bits).
THRESHOLDS = {"tensorwise": (25, 21, 21), "rowwise": (25, 25, 25), "rowwise_gw_hp": (25, 25, 45)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sqnr_vs_float64(recipe, dtype):
    x, w, gy = make_inputs(dtype)
    y, gx, gw, _ = run_fp8(recipe, x, w, gy, emulate=True)
    assert y.dtype == dtype and gx.dtype == dtype and gw.dtype == dtype
    for name, got, ref, lo in zip(("y", "gx", "gw"), (y, gx, gw), reference(x, w, gy), THRESHOLDS[recipe]):
        assert torch.isfinite(got).all(), name
        assert sqnr(got, ref) > lo, (name, sqnr(got, ref))
    # All-zero input rows give exactly zero outputs (no NaN from a 0/0 scale).
    assert (y[:3] == 0).all()


def scaled_mm_device() -> torch.device:
    """Where the torch._scaled_mm path runs for real: a GPU with FP8 matrix units when there is one (the path the
    product takes there), else the CPU, whose _scaled_mm takes per-row scales in the torch the Makefile installs
    (torch 2.11's CPU kernel took per-tensor scales only: the rowwise cases failed on the GPU image's CPU)."""
    from fp8.backend import get_backend

    if torch.cuda.is_available() and not get_backend(torch.device("cuda")).emulate:
        return torch.device("cuda")
    return torch.device("cpu")


def cpu_scaled_mm_takes_row_scales() -> bool:
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(16, 32).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_emulated_equals_scaled_mm_path(recipe):
    device = scaled_mm_device()
    if device.type == "cpu" and recipe != "tensorwise" and not cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only (no GPU here to run "
                    "the rowwise path; the product emulates it on CPUs)")
    x, w, gy = (t.to(device) for t in make_inputs(torch.float32, seed=1))
    emu = run_fp8(recipe, x, w, gy, emulate=True)[:3]
    real = run_fp8(recipe, x, w, gy, emulate=False)[:3]
    # Same fp8 operands. On the CPU only the accumulation order differs, and rowwise _scaled_mm rounds its output to
    # bf16. On a GPU the forward also accumulates fast (FP8 tensor cores keep fewer bits in their partial sums): the
    # tensorwise output there was 3.4e-4 from the emulation on an H100.
    tol = 1e-5 if recipe == "tensorwise" and device.type == "cpu" else 4e-3
    for a, b in zip(emu, real):
        assert ((a - b).norm() / b.norm()).item() < tol


def test_fp8_differs_from_high_precision():
    """Guard against a silently high-precision 'fp8' path: error must be at the fp8 level, not bf16's."""
    x, w, gy = make_inputs(torch.float32, seed=2)
    y, *_ = run_fp8("rowwise", x, w, gy, emulate=True)
    assert 20 < sqnr(y, reference(x, w, gy)[0]) < 40


@pytest.mark.parametrize("autocast", [False, True])
def test_scaled_mm_emulated_matches_dequantized_product(autocast):
    """Under bf16 autocast too (a training forward): the float32 product, as _scaled_mm computes it, not a bf16 matmul
    of bf16-rounded operands (which also ran many times slower on CPUs without native bf16)."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 48, generator=g)
    a8, sa = quantize_rowwise_ref(a, torch.float8_e4m3fn, True, dim=-1)
    b8, sb = quantize_rowwise_ref(b, torch.float8_e4m3fn, True, dim=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = scaled_mm(a8, b8, sa, sb, torch.float32, use_scaled_mm=False)
        assert torch.is_autocast_enabled("cpu") == autocast  # the caller's autocast state is left as it was
    expect = (a8.double() / sa.double()) @ (b8.double() / sb.double())
    assert torch.allclose(out.double(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("emulate", [True, False])
def test_tensorwise_float32_master_weight_gradient_comes_out_of_the_gemm_in_float32(emulate):
    """A float32 master weight under bf16 autocast (one worker's training step): the weight gradient is the float32
    product of the fp8 operands as the GEMM writes it, not a bf16 result converted afterwards (that conversion was a
    kernel of its own per layer). Both the emulated and the torch._scaled_mm path (tensorwise: CPU and GPU)."""
    device = scaled_mm_device()
    x, w, gy = (t.to(device) for t in make_inputs(torch.float32, seed=5))
    lin = torch.nn.Linear(K, N, bias=False, device=device)
    with torch.no_grad():
        lin.weight.copy_(w)
    mod = Float8Linear.from_float(lin, "tensorwise")
    mod.emulate = emulate
    xi = x.clone().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = mod(xi)
    assert y.dtype == torch.bfloat16
    y.backward(gy.bfloat16())
    gw = lin.weight.grad
    assert gw.dtype == torch.float32
    assert not torch.equal(gw, gw.bfloat16().float())
    # The same product from the references: gy (bf16, as autocast's backward hands it) cast e5m2, x cast e4m3 from its
    # bf16 autocast copy, multiplied dequantized in float64.
    g8, sg = quantize_tensorwise_ref(gy.bfloat16(), torch.float8_e5m2)
    x8, sx = quantize_tensorwise_ref(x.bfloat16(), torch.float8_e4m3fn)
    expect = (g8.double() / sg.double()).t() @ (x8.double() / sx.double())
    # float32 accumulation is ~1e-7 of the norm (measured on CPU: both paths); a bf16 rounding of the result ~1e-3.
    assert ((gw.double() - expect).norm() / expect.norm()).item() < 1e-6


def test_amax_to_scale_finite_on_zero_tiny_and_pow2():
    for pow2 in (False, True):
        s = amax_to_scale(torch.tensor([0.0, 1e-30, 1e-3, 3.0, 1e6]), torch.float8_e4m3fn, pow2)
        assert torch.isfinite(s).all() and (s > 0).all()
    s = amax_to_scale(torch.tensor([3.0, 0.7, 1e-5]), torch.float8_e4m3fn, True)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # exact powers of two
    assert (torch.tensor([3.0, 0.7, 1e-5]) * s <= 448.0).all()
    assert (torch.tensor([3.0, 0.7, 1e-5]) * s > 224.0).all()  # largest power of two that fits
    # A NaN amax (NaN in the input) gives a NaN scale with or without pow2, as the Triton kernels do; an inf amax
    # gives a zero scale.
    special = torch.tensor([float("nan"), float("inf"), 3.0])
    for pow2 in (False, True):
        s = amax_to_scale(special, torch.float8_e4m3fn, pow2)
        assert s[0].isnan() and s[1].item() == 0.0 and torch.isfinite(s[2])


def test_quantize_all_zero_and_tiny_inputs():
    z = torch.zeros(4, 8)
    for q, s in (quantize_tensorwise_ref(z, torch.float8_e4m3fn), quantize_rowwise_ref(z, torch.float8_e4m3fn)):
        assert (q.float() == 0).all() and torch.isfinite(s).all()
    tiny = torch.full((2, 8), 1e-20)
    q, s = quantize_rowwise_ref(tiny, torch.float8_e4m3fn)
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    # Saturating cast: values beyond the range clamp to +-max instead of NaN (e4m3fn has no inf).
    out = saturated_cast(torch.tensor([1e9, -1e9]), torch.tensor(1.0), torch.float8_e4m3fn)
    assert out.float().tolist() == [448.0, -448.0]


def test_row_and_col_reference_layouts():
    x = torch.randn(24, 40)
    q, s_m1, qt, s_1n = quantize_rowwise_and_colwise_ref(x, torch.float8_e4m3fn)
    assert qt.shape == (40, 24) and qt.is_contiguous() and s_m1.shape == (24, 1) and s_1n.shape == (1, 40)
    assert sqnr(q.float() / s_m1, x) > 25 and sqnr(qt.t().float() / s_1n, x) > 25
    assert torch.equal(s_1n, quantize_rowwise_ref(x, torch.float8_e4m3fn, dim=0)[1])


def test_health_stats_on_device_no_sync():
    x, w, gy = make_inputs(torch.float32)
    x[10, 10:] = 1e-9  # underflows to zero next to an outlier channel of the same row
    _, _, _, mod = run_fp8("tensorwise", x, w, gy, emulate=True)
    sat, under, amax = mod.fp8_health_stats.tolist()
    assert amax == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert sat == 0.0  # a dynamic scale maps amax onto +-448: nothing is clipped, even the outlier channel
    # The underflow fraction, counted by hand over the sampled rows: nonzero inputs whose fp8 value is zero.
    from fp8.health import health_sample_step
    x_fp8, _ = quantize_tensorwise_ref(x, torch.float8_e4m3fn)
    rows = slice(None, None, health_sample_step(x.shape[0]))
    want_under = ((x[rows] != 0) & (x_fp8[rows].float() == 0)).float().mean().item()
    assert want_under > 0 and under == pytest.approx(want_under, rel=1e-6)


def test_health_stats_count_clipped_values_not_values_at_max():
    from fp8.linear import health_stats

    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    e4m3 = torch.float8_e4m3fn
    exact = 448.0 / x.abs().max()
    x_fp8 = (x * exact).clamp(-448, 448).to(e4m3)
    assert health_stats(x, x_fp8, exact, e4m3)[0].item() == 0.0
    stale = exact * 4  # a scale 4x too large (e.g. a delayed scale after the amax grew): values clip
    x_fp8 = (x * stale).clamp(-448, 448).to(e4m3)
    # Counted by hand over the rows the statistics sample: values past 448 by more than half its step of 32
    # (464); values between 448 and 464 round to max without clipping and must not count.
    from fp8.health import health_sample_step

    rows = slice(None, None, health_sample_step(x.shape[0]))
    scaled = (x[rows] * stale).abs()
    clipped = (scaled > 464).float().mean().item()
    assert clipped > 0.005 and ((scaled > 448) & (scaled <= 464)).any()
    assert health_stats(x, x_fp8, stale, e4m3)[0].item() == pytest.approx(clipped, rel=1e-6)


def test_bias_and_leading_dims():
    lin = torch.nn.Linear(32, 16)
    mod = Float8Linear.from_float(lin, "rowwise")
    x = torch.randn(2, 5, 32)
    y = mod(x)
    assert y.shape == (2, 5, 16)
    assert sqnr(y, lin(x)) > 24
    mod.fp8_enabled = False
    assert torch.equal(mod(x), lin(x))


def test_first_kernel_lookup_inside_a_compiled_backward_keeps_one_graph(monkeypatch):
    """The kernels package's first lookup may happen while dynamo traces an autograd.Function's backward (a
    tensorwise Float8Linear first reaches it there, for its fp8 transposes). It must not store module state then:
    such a store is a side effect dynamo refuses inside the Function, and the whole Function graph-broke and ran
    eagerly, costing host time every step. fullgraph=True turns a break into an error."""
    from fp8 import quant

    monkeypatch.setattr(quant, "_KERNELS_LOOKED_UP", False)
    monkeypatch.setattr(quant, "_KERNELS_MODULE", None)

    class LooksUpInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * (3 if quant._kernels() is not None else 5)

    torch._dynamo.reset()
    fn = torch.compile(lambda x: LooksUpInBackward.apply(x), fullgraph=True, backend="aot_eager")
    x = torch.ones(4, requires_grad=True)
    fn(x).sum().backward()
    expected = 3.0 if quant._import_kernels() is not None else 5.0
    torch.testing.assert_close(x.grad, torch.full((4,), expected))
    assert quant._KERNELS_LOOKED_UP is False  # nothing stored while tracing; the eager path stores it
    assert (quant._kernels() is not None) == (expected == 3.0) and quant._KERNELS_LOOKED_UP is True


def test_kernel_failure_while_tracing_a_backward_falls_back_without_breaking_the_graph(monkeypatch):
    """A kernel that raises while dynamo traces an autograd.Function runs the reference in the graph without
    recording the failure or warning there (both are side effects dynamo refuses inside the Function, which would
    then run eagerly); the eager path records it and warns once."""
    from fp8 import quant

    monkeypatch.setattr(quant, "_FAILED", set())

    def broken_kernel(x):
        raise RuntimeError("unsupported shape")

    class FallsBack(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            out = quant._attempt(quant.CASTS["transpose"], broken_kernel, None, g)
            return (g * 7) if out is None else out

    torch._dynamo.reset()
    fn = torch.compile(lambda x: FallsBack.apply(x), fullgraph=True, backend="aot_eager")
    x = torch.ones(4, requires_grad=True)
    fn(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 7.0))
    assert quant._FAILED == set()
    with pytest.warns(UserWarning, match="transpose failed"):
        assert quant._attempt(quant.CASTS["transpose"], broken_kernel, None, x) is None
    assert quant._FAILED == {"transpose"}


def test_tensorwise_backward_gemms_get_transposed_fp8_copies_in_scaled_mm(monkeypatch):
    """Through torch._scaled_mm (row-major A, column-major B): the tensorwise backward keeps x and w in their forward
    layouts and scaled_mm makes the transposed fp8 copies of x, w and gy its GEMMs read (3 of the 6 operands)."""
    from fp8 import linear

    copies = []
    row_major, col_major = linear._row_major, linear._col_major
    monkeypatch.setattr(linear, "_row_major", lambda a: copies.append(a.stride(-1) != 1) or row_major(a))
    monkeypatch.setattr(linear, "_col_major", lambda b: copies.append(b.stride(-2) != 1) or col_major(b))
    x, w, gy = make_inputs(torch.bfloat16, seed=4)
    run_fp8("tensorwise", x, w, gy, emulate=False)
    assert len(copies) == 6  # 3 GEMMs x 2 operands
    assert sum(copies) == 3
