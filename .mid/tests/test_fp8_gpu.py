"""GPU-only checks of the Triton ops under torch.compile (skipped without CUDA; run on the H200 by the device tool).

What they pin down: Inductor launches the quantize kernels itself (the compiled code holds no call back into the
elastic_fp8 ops, which would cost a Python dispatch per cast at run time), the compiled ops give bit-identical
results to the eager launchers, and a compiled Float8Linear matches the eager one.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import REPO, repo_on_path
from tests.numerics import sqnr

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E4M3 = torch.float8_e4m3fn
DEVICE = "cuda"


def _x(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, device="cuda", generator=g, dtype=torch.float32)
    x[3] *= 50.0  # an outlier row, so row and column scales differ
    return x.to(torch.bfloat16)


def _cases():
    from fp8.kernels import quantize as q
    from fp8.kernels import transposed as t

    ops = torch.ops.elastic_fp8
    return [
        ("tensorwise", lambda x: ops.quantize_tensorwise(x * 2, E4M3, None),
         lambda x: q.quantize_tensorwise_triton(x * 2, E4M3, None)),
        ("rowwise", lambda x: ops.quantize_rowwise(x * 2, E4M3, True),
         lambda x: q.quantize_rowwise_triton(x * 2, E4M3, True)),
        ("rowwise_and_colwise", lambda x: ops.quantize_rowwise_and_colwise(x * 2, E4M3, True),
         lambda x: q.quantize_rowwise_and_colwise_triton(x * 2, E4M3, True)),
        ("transpose", lambda x: (ops.transpose((x * 2).to(E4M3)),), lambda x: (t.transpose_triton((x * 2).to(E4M3)),)),
    ]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_and_colwise", "transpose"])
def test_compiled_ops_launch_the_kernels_inline_and_match_eager(name):
    from torch._inductor.utils import run_and_get_code

    import fp8.kernels  # noqa: F401  # registers the ops

    torch._dynamo.reset()
    _, op_fn, eager_fn = next(c for c in _cases() if c[0] == name)
    x = _x(1024, 768, seed=1)
    got, codes = run_and_get_code(torch.compile(op_fn, fullgraph=True), x)
    want = eager_fn(x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.view(torch.uint8) if g.dtype == E4M3 else g, w.view(torch.uint8) if w.dtype == E4M3
                           else w)
    code = "\n".join(codes)
    assert "elastic_fp8" not in code, "the compiled code calls back into the op instead of launching its kernels"
    assert "_kernel" in code  # the user kernels appear by name in Inductor's wrapper


def test_compiled_float8_linear_with_kernel_casts_matches_eager():
    """Compiled: the tensorwise cast traced by Inductor, the fp8 transposes and rowwise casts kernels; the same
    function as eager."""
    import fp8

    torch._dynamo.reset()
    torch.manual_seed(0)
    for recipe in ("tensorwise", "rowwise"):
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024, bias=False), torch.nn.Linear(1024, 256, bias=False))
        model = model.cuda().to(torch.bfloat16)
        fp8.convert_to_fp8(model, recipe, module_filter=lambda m, fqn: True)
        x = _x(2048, 512, seed=2).requires_grad_(True)
        y_eager = model(x)
        y_eager.float().square().mean().backward()
        grads_eager = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        for p in model.parameters():
            p.grad = None
        x.grad = None
        y_comp = torch.compile(model)(x)
        y_comp.float().square().mean().backward()
        grads_comp = [p.grad for p in model.parameters()] + [x.grad]
        if recipe == "rowwise":
            # The same cast kernels and GEMMs as eager; Inductor may reorder the fp32 accumulation of the loss only.
            torch.testing.assert_close(y_comp, y_eager, rtol=0, atol=0)
            for g_c, g_e in zip(grads_comp, grads_eager, strict=True):
                torch.testing.assert_close(g_c, g_e, rtol=1e-2, atol=1e-3)
        else:
            # Inductor's own tensorwise cast: its fp32 scale arithmetic may differ from the kernel's by an ulp,
            # which moves the odd element across an fp8 rounding boundary (an fp8 step is 6-12%, so elementwise
            # tolerances do not apply). Independent fp8 roundings would agree to ~30 dB; the same casts up to such
            # ties agree to far more.
            for what, g_c, g_e in zip(["y", "w1", "w2", "x"], [y_comp, *grads_comp], [y_eager, *grads_eager],
                                      strict=True):
                assert sqnr(g_c, g_e) > 45, (recipe, what, sqnr(g_c, g_e))
        torch._dynamo.reset()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_moe_block_graph_breaks(precision):
    """A graph break inside a compiled MoE block leaves eager segments whose launches the GPU waits for: none in
    bf16 and none in fp8 (the FP8 grouped GEMMs are custom-op nodes of the graph, fp8.grouped's "opaque" mode)."""
    torch._dynamo.reset()
    model = _moe_model(precision, compiled=False)
    block = list(model.layers.values())[-1]
    captured = {}
    handle = block.register_forward_pre_hook(lambda mod, args, kwargs: captured.update(args=args, kwargs=kwargs),
                                             with_kwargs=True)
    model(torch.randint(0, 1024, (2, 256), device=DEVICE))
    handle.remove()
    explained = torch._dynamo.explain(block)(*captured["args"], **captured["kwargs"])
    reasons = [str(b.reason)[:300] for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons


def _moe_model(precision: str, compiled: bool, grouped_mode: str = "opaque"):
    import fp8
    from models.deepseek_moe import set_forward_recompute
    from models.registry import build_model

    model = build_model("deepseek_moe16b", device=DEVICE, overrides={
        "n_layers": 2, "dim": 512, "moe_inter_dim": 256, "inter_dim": 1024, "n_routed_experts": 16,
        "vocab_size": 1024, "n_heads": 4})
    model.init_weights(seed=0)
    model.to(torch.bfloat16).train()
    set_forward_recompute(model, False)
    if precision == "fp8":
        fp8.convert_to_fp8(model, "rowwise")
        for module in model.modules():
            if fp8.convert.is_fp8_grouped(module):
                module.grouped_mm.mode = grouped_mode
    if compiled:
        for block in model.layers.values():
            block.compile(dynamic=False)
    return model


def _keep_output(store: dict, module, args, out) -> None:
    store["y"] = out.detach().clone()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize("compiled,grouped_mode", [(False, "opaque"), (True, "opaque"), (True, "eager")],
                         ids=["eager", "compiled-opaque", "compiled-eager-grouped"])
def test_fp8_moe_model_expert_grads_follow_bf16(compiled, grouped_mode):
    """Every routed expert's weight gradient in the FP8 model points where the bf16 model's does."""
    torch._dynamo.reset()
    tokens = torch.randint(0, 1024, (2, 512), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(3))
    grads, outs = {}, {}
    for precision in ("bf16", "fp8"):
        model = _moe_model(precision, compiled, grouped_mode)
        captured: dict[str, torch.Tensor] = {}
        model.layers["1"].moe.experts.register_forward_hook(functools.partial(_keep_output, captured))
        logits = model(tokens)
        logits.float().square().mean().backward()
        outs[precision] = captured["y"]
        grads[precision] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "experts.w" in n}
    y_bf16, y_fp8 = outs["bf16"], outs["fp8"]
    # Compare magnitudes, not rows: fp8's rounding moves every row a little.
    ratio = (y_fp8.float().abs().sum() / y_bf16.float().abs().sum()).item()
    assert 0.9 < ratio < 1.1, f"sum |experts output| fp8 / bf16 = {ratio:.4f}"
    report = {n: (_cosine(grads["fp8"][n], g), (grads["fp8"][n] == 0).float().mean().item(),
                  (g == 0).float().mean().item()) for n, g in grads["bf16"].items()}
    for name, (cos, zero_fp8, zero_bf16) in report.items():
        assert cos > 0.9 and zero_fp8 <= zero_bf16 + 0.01, f"{name}: cos, zero frac fp8, bf16 = {report}"


def test_fp8_grouped_experts_with_model_routing_match_bf16():
    """The experts module alone on model-style routing (groups of any size, one after the other)."""
    from fp8.grouped import Fp8GroupedMM
    from models.deepseek_moe import GroupedExperts, permute_by_expert

    torch.manual_seed(0)
    experts = GroupedExperts(16, 512, 256).cuda()
    experts.init_weights(0.02, 0.02)
    experts.to(torch.bfloat16)
    expert_SA = torch.randint(0, 16, (1024, 6), device="cuda")
    token_R, _slot_R, offs_E = permute_by_expert(expert_SA, 16)
    x_SD = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    x_RD = x_SD[token_R]
    results = {}
    for name, op in (("bf16", experts.grouped_mm), ("fp8", Fp8GroupedMM())):
        experts.grouped_mm = op
        experts.zero_grad(set_to_none=True)
        y = experts(x_RD, offs_E)
        torch.manual_seed(1)
        gy = torch.randn_like(y)
        y.backward(gy)
        results[name] = (y.detach().clone(), experts.w13.grad.clone(), experts.w2.grad.clone())
    for i, what in enumerate(("y", "grad_w13", "grad_w2")):
        cos = _cosine(results["fp8"][i], results["bf16"][i])
        assert cos > 0.95, f"{what}: cos {cos:.4f}, fp8 |.| {results['fp8'][i].float().abs().mean():.3e}, bf16 " \
                           f"{results['bf16'][i].float().abs().mean():.3e}, offs {offs_E.tolist()}"


@pytest.mark.parametrize("dims", [(2048, 2816), (1408, 2048)])  # DeepSeek-MoE's w13 and w2
def test_grouped_op_compiled_body_matches_eager_body(dims):
    """fp8.grouped's compiled op bodies (the CUDA default) compute the eager bodies' numbers: the same casts, GEMMs
    and health statistics, forward and both gradients."""
    from fp8 import grouped as fp8_grouped
    from fp8.grouped import Fp8GroupedMM

    K, N = dims
    E, M = 8, 4096
    g = torch.Generator(device="cuda").manual_seed(K)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w_ENK = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    gy = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    offs = torch.tensor([512 * (e + 1) for e in range(E)], dtype=torch.int32, device="cuda")
    results = {}
    try:
        for body in ("eager", "compiled"):
            fp8_grouped.set_body_mode(body)
            xr, wr = x.clone().requires_grad_(), w_ENK.clone().requires_grad_()
            mm = Fp8GroupedMM(mode="opaque")
            out = mm(xr, wr.transpose(-2, -1), offs)
            out.backward(gy)
            results[body] = (out.detach(), xr.grad, wr.grad, mm.last_stats.clone())
    finally:
        fp8_grouped.set_body_mode(None)
    for name, a, b in zip(("out", "grad_x", "grad_w", "stats"), results["eager"], results["compiled"]):
        diff = (a.float() - b.float()).abs().max().item()
        assert torch.equal(a, b), f"{name}: compiled body differs from eager by up to {diff}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_dispatch_runs_every_cast_through_its_kernel_and_matches_the_reference():
    """fp8.quant on CUDA tensors: the policy picks each cast's launcher in eager code, and every public cast equals its
    reference bit for bit. Compiled, the casts kept as kernels launch our kernel inline (same bits), the tensorwise
    cast is Inductor's own (fused into its producers), and no kernel failed."""
    from torch._inductor.utils import run_and_get_code

    from fp8 import kernels, quant, reference

    x = _x(1024, 768, seed=21)
    for name, cast in quant.CASTS.items():
        assert quant._kernel_for(cast, x, None) is getattr(kernels, f"{name}_triton"), name
    w_ENK = torch.stack([_x(96, 768, seed=22 + e) for e in range(3)])  # expert weights, [E, N, K] storage
    scale_EN = reference.quantize_rowwise_ref(w_ENK, E4M3)[1].squeeze(-1)
    gid = torch.repeat_interleave(torch.arange(3, device="cuda", dtype=torch.int32),
                                  torch.tensor([500, 24, 500], device="cuda"))
    mul = torch.exp2(torch.randint(-4, 5, (3, 768), device="cuda").float())
    # (dispatched, defined, our kernel in compiled code: its name, or None where Inductor writes the cast)
    cases = {
        "tensorwise": (lambda a: quant.quantize_tensorwise(a * 2, E4M3),
                       lambda a: reference.quantize_tensorwise_ref(a * 2, E4M3), None),
        "rowwise": (lambda a: quant.quantize_rowwise(a * 2, E4M3), lambda a: reference.quantize_rowwise_ref(a * 2, E4M3),
                    "_rowwise_kernel"),
        "rowwise_and_colwise": (lambda a: quant.quantize_rowwise_and_colwise(a * 2, E4M3),
                                lambda a: reference.quantize_rowwise_and_colwise_ref(a * 2, E4M3),
                                "_row_col_cast_kernel"),
        "transpose": (lambda a: (quant.transpose((a * 2).to(E4M3)),),
                      lambda a: (reference.transpose_ref((a * 2).to(E4M3)),), "_transpose_kernel"),
        "group_scaled": (lambda a: quant.quantize_rowwise_group_scaled(a * 2, mul, gid, E4M3),
                         lambda a: reference.quantize_rowwise_group_scaled_ref(a * 2, mul, gid, E4M3),
                         "_rowwise_group_scaled_kernel"),
        "transpose_batched": (lambda a: (quant.transpose((w_ENK * 2).to(E4M3)),),
                              lambda a: (reference.transpose_ref((w_ENK * 2).to(E4M3)),), "_transpose_kernel"),
        "rows_transposed_batched": (lambda a: (quant.cast_rows_transposed_batched(w_ENK * 2, scale_EN, E4M3),),
                                    lambda a: (reference.cast_rows_transposed_batched_ref(w_ENK * 2, scale_EN, E4M3),),
                                    "_batched_row_scaled_cast_t_kernel"),
        "colwise_3d": (lambda a: quant.quantize_colwise_3d((w_ENK * 2).transpose(-2, -1), E4M3),
                       lambda a: reference.quantize_rowwise_ref((w_ENK * 2).transpose(-2, -1), E4M3, True, -2),
                       "_rowwise_kernel"),
    }
    for name, (dispatched, defined, kernel_name) in cases.items():
        want = defined(x)
        got = dispatched(x)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and torch.equal(_bits(g), _bits(w)), (name, "eager")
        torch._dynamo.reset()
        got, codes = run_and_get_code(torch.compile(dispatched, fullgraph=True), x)
        code = "\n".join(codes)
        assert "elastic_fp8" not in code, name
        if kernel_name is None:
            assert "_cast_tensorwise_kernel" not in code and "_amax_kernel" not in code, name
            continue
        assert kernel_name in code, name
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and torch.equal(_bits(g), _bits(w)), (name, "compiled")
    assert quant._FAILED == set()


@pytest.mark.parametrize("n", [2816, 2048, 53])
def test_group_scaled_row_cast_matches_reference_on_gpu(n):
    """The grad-input GEMM's gradient cast (one multiplier vector per block where its rows share a group, a gather
    where they straddle two): bit-equal to the reference with fp32 and bf16 (power-of-two) multipliers, groups of
    uneven sizes (one empty, some smaller than a block) and rows past the last group (multiplier 0)."""
    from fp8.kernels import quantize as q
    from fp8.reference import quantize_rowwise_group_scaled_ref

    g = torch.Generator(device="cuda").manual_seed(n)
    sizes = torch.tensor([700, 0, 3, 1, 1300, 5, 2048, 9], device="cuda")
    gid = torch.repeat_interleave(torch.arange(len(sizes), device="cuda", dtype=torch.int32), sizes)
    gid = torch.cat([gid, torch.full((7,), len(sizes), device="cuda", dtype=torch.int32)])  # rows past the groups
    mul = torch.exp2(torch.randint(-6, 7, (len(sizes), n), device="cuda", generator=g).float())
    mul = torch.cat([mul, mul.new_zeros(1, n)])
    x = _x(gid.numel(), n, seed=n)
    want, s_want = quantize_rowwise_group_scaled_ref(x, mul, gid, E4M3)
    for m in (mul, mul.bfloat16()):
        got, s_got = q.quantize_rowwise_group_scaled_triton(x, m, gid, E4M3)
        assert torch.equal(s_got, s_want)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not got[-7:].float().any()


def test_fp8_grouped_unaligned_token_groups_match_padded_on_gpu():
    """Token groups of any size (3, 1, 0, 517 rows, ...) straight into torch._scaled_grouped_mm and our casts, as the
    model routes them, with the bf16 weight gradient. Output, grad_x and grad_w equal those of the same rows padded to
    16-row groups with zeros within bf16 rounding, and grad_x is as accurate against float64. What this pins: torch's
    rowwise kernel reads the per-row scales of a group that starts at an unaligned row correctly."""
    from fp8.grouped import Fp8GroupedMM

    E, K, N = 8, 2048, 1408
    sizes = [1000, 3, 0, 517, 1, 2048, 77, 450]
    g = torch.Generator(device="cuda").manual_seed(7)
    M = sum(sizes)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    x[:, :4] *= 30.0
    gy = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    w_ENK = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    padded_sizes = [(n + 15) // 16 * 16 for n in sizes]
    # row i of the unpadded layout sits at row dest[i] of the padded one
    dest = torch.cat([torch.arange(n, device="cuda") + sum(padded_sizes[:e]) for e, n in enumerate(sizes)])
    results = {}
    for layout, group_sizes in (("unpadded", sizes), ("padded", padded_sizes)):
        rows = sum(group_sizes)
        xi = x if layout == "unpadded" else x.new_zeros(rows, K).index_copy(0, dest, x)
        gyi = gy if layout == "unpadded" else gy.new_zeros(rows, N).index_copy(0, dest, gy)
        offs = torch.tensor(group_sizes, device="cuda").cumsum(0).to(torch.int32)
        xr, wr = xi.clone().requires_grad_(), w_ENK.clone().requires_grad_()
        out = Fp8GroupedMM(mode="opaque")(xr, wr.transpose(-2, -1), offs)
        out.backward(gyi)
        pick = (lambda t: t) if layout == "unpadded" else (lambda t: t[dest])
        results[layout] = (pick(out.detach()), pick(xr.grad), wr.grad)
    for name, a, b in zip(("out", "grad_x", "grad_w"), results["unpadded"], results["padded"]):
        assert a.isfinite().all() and (a != 0).any(), name
        # bf16 rounding of fp32 sums whose order may differ with the tiling of the groups: relative to the tensor's
        # scale, as a sum's rounding error is (an element near zero from cancellation keeps its terms' error)
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3 * b.abs().max().item(), msg=name)
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    gx_ref = torch.cat([gy[bounds[e]:bounds[e + 1]].double() @ w_ENK[e].double() for e in range(E)])
    assert sqnr(results["unpadded"][1], gx_ref) > sqnr(results["padded"][1], gx_ref) - 0.1


@pytest.mark.parametrize("dims", [(2048, 2816), (1408, 2048)])  # DeepSeek-MoE's w13 and w2: gx contracts over N
def test_grouped_fast_accum_grad_input_keeps_fp8_accuracy(dims):
    """The grad-input GEMM runs with the tensor cores' fast accumulation on the forward's quantized weight: its grad_x
    stays within 0.5 dB of the SQNR against float64 that exact accumulation of the same fp8 operands reaches. Inputs
    with outlier channels and all-zero rows."""
    from fp8 import quant as fp8_quant
    from fp8.grouped import Fp8GroupedMM

    K, N = dims
    E, M = 8, 8192
    g = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    x[:, :4] *= 30.0
    x[:16] = 0.0
    w_ENK = (torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    gy = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    gy[:, :4] *= 30.0
    offs = torch.tensor([1024 * (e + 1) for e in range(E)], dtype=torch.int32, device="cuda")
    gx_ref = torch.cat([gy[1024 * e:1024 * (e + 1)].double() @ w_ENK[e].double() for e in range(E)])
    xr, wr = x.clone().requires_grad_(), w_ENK.clone().requires_grad_()
    Fp8GroupedMM(mode="opaque")(xr, wr.transpose(-2, -1), offs).backward(gy)
    # The same fp8 operands, accumulated exactly: the forward's quantized weight and gy / sw quantized per row.
    q_EKN, sw_E1N = fp8_quant.quantize_colwise_3d(w_ENK.transpose(-2, -1), E4M3, True)
    inv_sw_EN = sw_E1N.reshape(E, N).reciprocal()
    gid = torch.arange(M, device="cuda") // 1024
    g8, sg = fp8_quant.quantize_rowwise((gy.float() * inv_sw_EN[gid]), E4M3, -1, True)
    exact = torch.cat([(g8[1024 * e:1024 * (e + 1)].double() / sg[1024 * e:1024 * (e + 1)].double())
                       @ q_EKN[e].double().t() for e in range(E)])
    exact_db, fast_db = sqnr(exact, gx_ref), sqnr(xr.grad, gx_ref)
    assert 23 < exact_db < 40 and fast_db > exact_db - 0.5, (dims, exact_db, fast_db)


@pytest.mark.parametrize("mark_steps", [True, False], ids=["marked", "unmarked"])
def test_fp8_moe_model_under_cuda_graphs_matches_default_compile(mark_steps):
    """model.compile_mode=reduce-overhead (CUDA-graph trees) as the worker's compile_blocks sets it up (eager grouped-op
    bodies): three training-style steps (fresh inputs, backward) run, and the last step's loss and expert gradients
    equal those of the same model compiled without graphs. "marked" is the worker's loop (a step mark before each
    forward); "unmarked" is a user's plain loop, where the trees find iterations by dynamo's generation counter - the
    case that failed on the H200 with compiled bodies ("accessing tensor output of CUDAGraphs that has been
    overwritten"), since entering a compiled body bumps that counter."""
    from fp8 import grouped as fp8_grouped

    results = {}
    try:
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            model = _moe_model("fp8", compiled=False)
            # What orchestration.training.compile.compile_blocks does (that module needs the launcher's config libraries, not
            # on the GPU image; tests/test_fp8_grouped.py pins that compile_blocks sets the body mode this way).
            fp8_grouped.set_body_mode("eager" if mode == "reduce-overhead" else None)
            for block in model.layers.values():
                block.compile(dynamic=False, mode=None if mode == "default" else mode)
            gen = torch.Generator(DEVICE).manual_seed(5)
            for _ in range(3):
                tokens = torch.randint(0, 1024, (2, 512), device=DEVICE, generator=gen)
                model.zero_grad(set_to_none=True)
                if mode == "reduce-overhead" and mark_steps:
                    torch.compiler.cudagraph_mark_step_begin()
                loss = model(tokens).float().square().mean()
                loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "experts.w" in n}
            results[mode] = (loss.detach().clone(), grads)
    finally:
        fp8_grouped.set_body_mode(None)
    (loss_d, grads_d), (loss_g, grads_g) = results["default"], results["reduce-overhead"]
    torch.testing.assert_close(loss_g, loss_d, rtol=1e-3, atol=0)
    for name, g in grads_d.items():
        assert _cosine(grads_g[name], g) > 0.999, name


def test_tensorwise_float8_linear_compiles_to_one_graph_in_a_fresh_process():
    """In a new process (the kernels package not yet looked up), a compiled tensorwise Float8Linear is one graph
    with fullgraph=True, forward and backward, and matches eager. Its first kernel lookup happens while dynamo
    traces its backward; a module-state store there broke the graph and the layer ran eagerly (~120 ms of host a dense step on the H200)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from fp8 import Float8Linear\n"
        "torch.manual_seed(0)\n"
        "lin = Float8Linear.from_float(torch.nn.Linear(512, 1024, bias=False, device='cuda', dtype=torch.bfloat16),"
        " 'tensorwise')\n"
        "x = torch.randn(256, 512, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "outs = []\n"
        "for mod in (torch.compile(lin, fullgraph=True), lin):\n"
        "    x.grad, lin.weight.grad = None, None\n"
        "    y = mod(x); y.float().square().sum().backward()\n"
        "    outs.append((y.detach().clone(), x.grad.clone(), lin.weight.grad.clone()))\n"
        "for a, b in zip(*outs):\n"
        "    torch.testing.assert_close(a, b, rtol=0.02, atol=0.02)\n"
        "print('ONE GRAPH OK')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=repo_on_path())
    assert proc.returncode == 0 and "ONE GRAPH OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_fp8_output_head_matches_eager_and_float64(recipe):
    """precision.fp8_output_head on the GPU: a 16384-token head with peaked logits through torch._scaled_mm, eager and
    compiled (as compile_blocks compiles it): loss within 0.5% of float64, logits and gradients above 23 dB (the CPU
    emulation measures ~26.6-28.5 dB, tests/test_fp8_convert.py), compiled within fp8 rounding ties of eager."""
    from fp8 import Float8Linear
    from tests.numerics import head_loss_and_grads, lm_head_case

    torch._dynamo.reset()
    try:
        head, x, targets = lm_head_case(DEVICE)
        ref_head = torch.nn.Linear(head.in_features, head.out_features, bias=False).to(DEVICE, torch.float64)
        ref_head.weight.data.copy_(head.weight.double())
        ref = head_loss_and_grads(ref_head, x, targets, torch.float64)
        fp8_head = Float8Linear.from_float(head, recipe)
        eager = head_loss_and_grads(fp8_head, x, targets)
        assert fp8_head.fp8_health_valid  # the forward went through the FP8 path, not the bf16 one
        fp8_head.compile(dynamic=False)
        compiled = head_loss_and_grads(fp8_head, x, targets)
        for got in (eager, compiled):
            assert abs(got[0].item() - ref[0].item()) / ref[0].item() < 5e-3
            for what, g, r in zip(("logits", "grad_x", "grad_w"), got[1:], ref[1:], strict=True):
                # Below 40 dB: a head that silently ran in bf16 (~48 dB) must fail, as on the CPU twin.
                assert 23 < sqnr(g, r) < 40, (recipe, what, sqnr(g, r))
        for what, c, e in zip(("logits", "grad_x", "grad_w"), compiled[1:], eager[1:], strict=True):
            assert sqnr(c, e) > 40, (recipe, what, sqnr(c, e))
    finally:
        torch._dynamo.reset()


def test_compiled_tensorwise_float8_linear_launches_its_transposes_inline_in_backward():
    """The fp8 transposes of the backward GEMMs (x, w and the gradient) are Triton ops: inside the compiled backward
    Inductor must launch their kernels itself; a call back into elastic_fp8 would cost a Python dispatch each (a
    lone wo layer spent ~290 us of host per fwd+bwd on three transposes on the H200)."""
    from torch._inductor.utils import run_and_get_code

    import fp8

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512, bias=False)).cuda().to(torch.bfloat16)  # root: not replaced
    fp8.convert_to_fp8(model, "tensorwise", module_filter=lambda m, fqn: True)
    assert isinstance(model[0], fp8.Float8Linear)
    x = _x(2048, 1024, seed=3).requires_grad_(True)
    compiled = torch.compile(model)

    def step():
        compiled(x).float().square().mean().backward()

    _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    callbacks = [line.strip() for line in code.splitlines() if "elastic_fp8" in line]
    assert not callbacks, f"compiled code calls back into the ops: {callbacks[:6]}"
    assert code.count("_transpose_kernel") >= 3, "the three transposes should be launched as kernels"
    torch._dynamo.reset()
