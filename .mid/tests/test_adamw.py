"""optim.ChunkedAdamW: the Triton step against float64 AdamW, torch's AdamW state dict, the clip folded in.

The kernel runs on the CPU under TRITON_INTERPRET=1, which must be set before triton is imported, so the `_interp_*`
cases run in a child pytest (as in test_fp8_kernels.py). The interpreter rounds fp32 -> bf16 by truncation (Triton 3.9),
so bf16 cases allow one bf16 step; fp32 cases must agree with the float64 reference to fp32 rounding. The GPU cases
(skipped without CUDA) compare with torch's fused AdamW on the device.
"""

from __future__ import annotations

import copy

import pytest
import torch

from optim import ChunkedAdamW, adamw_reference_step
from optim import adamw as adamw_mod
from tests.interp_child import expose_or_run

KW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# Sizes around the chunk size (one partial chunk, exact chunks, a tiny tensor) with a small BLOCK so that the
# interpreter's cost per program stays low.
SIZES = ((3, 70), (64,), (5,), (2, 128), (300,), (0,))  # and an empty one


def make(dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in SIZES]


def grads_for(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(dtype=p.dtype, device=p.device) * (1 + i) for i, p in
            enumerate(params)]


def norm_of(grads):
    return torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])).float()


def reference_run(start, grad_seq, max_norm):
    """float64 AdamW with the clip, from `start`, over the gradient sequence; returns params and states."""
    p = [t.detach().double().clone() for t in start]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for step, grads in enumerate(grad_seq, start=1):
        coef = 1.0 if max_norm is None else min(1.0, max_norm / (float(norm_of(grads)) + 1e-6))
        for i in range(len(p)):
            adamw_reference_step(p[i], grads[i].double(), m[i], v[i], step, KW["lr"], *KW["betas"], KW["eps"],
                                 KW["weight_decay"], clip_coef=coef)
    return p, m, v


def run_ours(params, grad_seq, max_norm, opt=None):
    opt = opt or ChunkedAdamW(params, **KW)
    for grads in grad_seq:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if max_norm is None:
            opt.step()
        else:
            opt.clip_and_step(norm_of(grads), max_norm)
    return opt


# ----------------------------------------------------------------------------- interpreter cases (child process)

@pytest.fixture
def small_block(monkeypatch):
    monkeypatch.setattr(adamw_mod, "BLOCK", 64)


def _interp_fp32_matches_float64_reference_with_and_without_clip(small_block):
    for max_norm in (None, 0.5, 1e6):  # no clip, clip active, clip inactive
        params = make(torch.float32)
        start = [p.detach().clone() for p in params]
        seq = [grads_for(params, s) for s in range(4)]
        opt = run_ours(params, seq, max_norm)
        assert opt.kernel_steps == 4
        ref_p, ref_m, ref_v = reference_run(start, seq, max_norm)
        for i, p in enumerate(params):
            assert opt.state[p]["step"].item() == 4.0 and opt.state[p]["step"].dtype == torch.float32
            if p.numel() == 0:
                continue  # the empty parameter: counted, nothing to compare
            change = (ref_p[i] - start[i].double()).abs().max()
            assert change > 1e-3  # the steps moved the weights
            torch.testing.assert_close(p.double(), ref_p[i], rtol=2e-6, atol=2e-6 * float(change))
            torch.testing.assert_close(opt.state[p]["exp_avg"].double(), ref_m[i], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"].double(), ref_v[i], rtol=1e-5, atol=1e-9)


def _interp_states_show_the_clip(small_block):
    # Adam's update is nearly invariant to the gradient's scale, so the weights barely show a clip; the first moment
    # does: clipped to a quarter of the norm, exp_avg is a quarter of the unclipped one.
    params_a, params_b = make(torch.float32), make(torch.float32)
    seq = [grads_for(params_a, 8)]
    norm = float(norm_of(seq[0]))
    opt_a = run_ours(params_a, seq, norm / 4)
    opt_b = run_ours(params_b, seq, None)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(opt_a.state[a]["exp_avg"] * 4, opt_b.state[b]["exp_avg"], rtol=1e-5, atol=1e-7)


def _interp_bf16_within_one_bf16_step_of_float64(small_block):
    params = make(torch.bfloat16)
    start = [p.detach().clone() for p in params]
    seq = [grads_for(params, s) for s in range(3)]
    run_ours(params, seq, 1.0)
    ref_p, _, _ = reference_run(start, seq, 1.0)
    for p, r, s in zip(params, ref_p, start):
        # Each of the 3 steps stores the weight and the states in bf16 once more (the interpreter truncates): up to
        # about a bf16 step (2^-7 relative) of the value per step, the value taken along its path (start or end);
        # the float64 reference never rounds. Updates are ~lr = 1e-2, so a dropped or doubled update fails this.
        tol = 4 * 2.0**-7 * torch.maximum(r.abs(), s.double().abs())
        assert ((p.double() - r).abs() <= tol).all(), (p.double() - r).abs().max()


def _interp_state_dict_is_torchs_both_ways(small_block):
    # Ours for 2 steps -> torch's AdamW for 2 more, against ours for 4; and torch's state -> ours.
    seq = [grads_for(make(torch.float32), s) for s in range(4)]
    a = make(torch.float32)
    opt_a = run_ours(a, seq[:2], None)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = torch.optim.AdamW(b, foreach=False, **KW)
    # A copy: load_state_dict keeps tensors that already have the parameter's dtype and device (no copy), and the
    # two optimizers must not share states here.
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for grads in seq[2:]:
        for p, g in zip(b, grads):
            p.grad = g.clone()
        opt_b.step()
    run_ours(a, seq[2:], None, opt=opt_a)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    # torch -> ours: the loaded step counts (CPU scalars of an unfused run) are moved to float32 and continue.
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    opt_c = ChunkedAdamW(c, **KW)
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    run_ours(c, seq[:1], None, opt=opt_c)
    assert opt_c.kernel_steps == 1
    for grads in seq[:1]:
        for p, g in zip(b, grads):
            p.grad = g.clone()
        opt_b.step()
    for x, y in zip(c, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        assert opt_c.state[x]["step"].item() == 5.0


def _interp_new_gradient_addresses_every_step_and_params_without_grads(small_block):
    params = make(torch.float32)
    start = [p.detach().clone() for p in params]
    opt = ChunkedAdamW(params, **KW)
    seq = [grads_for(params, s) for s in range(3)]
    keep = []
    for grads in seq:
        for p, g in zip(params[:-1], grads):  # the last parameter never gets a gradient
            p.grad = g.clone()
            keep.append(p.grad)  # kept alive: the next step's gradients land at new addresses
        opt.step()
    assert opt.kernel_steps == 3
    ref_p, _, _ = reference_run(start[:-1], [g[:-1] for g in seq], None)
    for p, r in zip(params[:-1], ref_p):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=1e-7)
    assert torch.equal(params[-1], start[-1]) and len(opt.state[params[-1]]) == 0


def _interp_mixed_dtypes_run_as_buckets(small_block):
    params = make(torch.float32)
    params[1].data = params[1].data.to(torch.bfloat16)
    start = [p.detach().clone() for p in params]
    seq = [grads_for(params, s) for s in range(2)]
    opt = run_ours(params, seq, None)
    assert opt.kernel_steps == 2 and len(next(iter(opt._buckets.values()))[1]) == 2
    ref_p, _, _ = reference_run(start, seq, None)
    for i in (0, 2, 3, 4):
        torch.testing.assert_close(params[i].double(), ref_p[i], rtol=2e-6, atol=1e-7)


def _interp_unaligned_gradients_run_through_the_kernel(small_block):
    # Gradients as views into one flat buffer at offsets that are not 16-byte aligned (what FSDP2's reduce-scatter
    # output gives): the kernel still steps them (without the alignment hint), and right.
    params = make(torch.float32)
    start = [p.detach().clone() for p in params]
    opt = ChunkedAdamW(params, **KW)
    seq = [grads_for(params, s) for s in range(2)]
    for grads in seq:
        flat = torch.empty(1 + sum(g.numel() for g in grads))
        offset = 1  # 4 bytes into the buffer: the first gradient, at least, is not 16-byte aligned
        for p, g in zip(params, grads):
            view = flat[offset:offset + g.numel()].view(g.shape)
            view.copy_(g)
            p.grad = view
            offset += g.numel()
        assert any(p.grad.data_ptr() % 16 for p in params)
        opt.step()
    assert opt.kernel_steps == 2
    ref_p, _, _ = reference_run(start, seq, None)
    for p, r in zip(params, ref_p):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=1e-7)


def _interp_fsdp2_parameters_step_through_their_local_shards(small_block, tmp_path):
    # FSDP2 (one gloo rank: DTensor parameters, gradients and states) against torch's AdamW on the same model.
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        # A CPU mesh named explicitly: on a machine with a GPU fully_shard's default mesh is CUDA's (this case
        # failed on the H200 machine, and only there).
        mesh = init_device_mesh("cpu", (1,))

        def sharded_model():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8))
            for layer in model:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        ours, ref = sharded_model(), sharded_model()
        opt_ours, opt_ref = ChunkedAdamW(ours.parameters(), **KW), torch.optim.AdamW(ref.parameters(), **KW)
        x = torch.randn(16, 24)
        for _ in range(3):
            for model in (ours, ref):
                model(x).square().mean().backward()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().norm() for p in ours.parameters()]))
            opt_ours.clip_and_step(norm, 0.1)
            torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.1, norm)
            opt_ref.step()
            opt_ours.zero_grad()
            opt_ref.zero_grad()
        assert opt_ours.kernel_steps == 3
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def _interp_tensor_subclass_parameters_step_through_torch(small_block):
    # A parameter that is a wrapper tensor subclass (torchao's MoE FP8 recipe wraps expert weights so) has no storage
    # of its own at data_ptr(): a torchao row of train_step.py ran the kernel on such addresses and the GPU faulted
    # (illegal memory access). Such a group steps through torch's AdamW instead, exactly as torch does.
    from torch.testing._internal.two_tensor import TwoTensor

    def params():
        plain = make(torch.float32)[:2]
        base = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
        return plain + [torch.nn.Parameter(TwoTensor(base.clone(), base.clone()))]

    a, b = params(), params()
    opt_a, opt_b = ChunkedAdamW(a, **KW), torch.optim.AdamW(b, **KW)
    for s in range(2):
        grads = grads_for(a[:2], s) + [TwoTensor(torch.ones(4, 8) * (s + 1), torch.ones(4, 8) * (s + 1))]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert opt_a.kernel_steps == 0
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _interp_gated_step_takes_effect_only_with_gate_one(small_block):
    # The step launched before the guard's host read (orchestration.divergence.agreement.agree_and_decide): gate 0 leaves
    # weights, states and step counts as they were; gate 1 is exactly the ungated step.
    a, b = make(torch.float32), make(torch.float32)
    opt_a, opt_b = ChunkedAdamW(a, **KW), ChunkedAdamW(b, **KW)
    for s in range(2):
        grads = grads_for(a, s)
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = norm_of(grads)
        assert opt_a.clip_and_step(norm, 0.5)
        before = [q.detach().clone() for q in b]
        states = {id(q): {k: v.clone() for k, v in opt_b.state[q].items()} for q in b}
        assert opt_b.clip_and_step(norm, 0.5, gate=torch.zeros(()))
        for q, q0 in zip(b, before):
            assert torch.equal(q, q0)
            for k, v in opt_b.state[q].items():
                expected = states[id(q)].get(k)
                assert torch.equal(v, expected) if expected is not None else not v.any()  # first step: fresh zeros
        assert opt_b.clip_and_step(norm, 0.5, gate=torch.ones(()))
    for p, q in zip(a, b):
        assert torch.equal(p, q) and opt_b.state[q]["step"].item() == 2.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a.state[p][k], opt_b.state[q][k])
    # torch's AdamW (here: a tensor lr) cannot take a gated step: nothing done, False.
    c = make(torch.float32)
    opt_c = ChunkedAdamW(c, lr=torch.tensor(1e-2))
    for p, g in zip(c, grads_for(c, 0)):
        p.grad = g
    before = [p.detach().clone() for p in c]
    assert not opt_c.clip_and_step(norm_of(grads_for(c, 0)), 0.5, gate=torch.ones(()))
    assert all(torch.equal(p, p0) for p, p0 in zip(c, before))


N_INTERP_CASES = 10

expose_or_run(globals(), __file__, N_INTERP_CASES, "test_kernel_cases_in_the_triton_interpreter")


# ----------------------------------------------------------------------------- torch's step where the kernel cannot run

def test_unsupported_settings_fall_back_to_torch_with_the_clip():
    # amsgrad (and, without the interpreter, every CPU run) steps through torch.optim.AdamW, clip included.
    for kwargs in ({"amsgrad": True}, {}):
        a = make(torch.float32)
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        opt_a = ChunkedAdamW(a, **KW, **kwargs)
        opt_b = torch.optim.AdamW(b, **KW, **kwargs)
        for s in range(2):
            grads = grads_for(a, s)
            for p, q, g in zip(a, b, grads):
                p.grad, q.grad = g.clone(), g.clone()
            norm = norm_of(grads)
            opt_a.clip_and_step(norm, 0.3)
            torch.nn.utils.clip_grads_with_norm_(b, 0.3, norm)
            opt_b.step()
        assert opt_a.kernel_steps == 0
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# ----------------------------------------------------------------------------- the GPU kernel against torch's fused AdamW

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_torch_fused_adamw(dtype):
    sizes = ((4096, 1000), (7,), (3, 5000), (64, 2048))
    g = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", dtype)) for s in sizes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    start = [p.detach().clone() for p in a]
    opt_a, opt_b = ChunkedAdamW(a, fused=True, **KW), torch.optim.AdamW(b, fused=True, **KW)
    for s in range(4):
        grads = [torch.randn(p.shape, generator=g).to("cuda", dtype) for p in a]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        norm = norm_of(grads).cuda()
        opt_a.clip_and_step(norm, float(norm) / 3)
        torch.nn.utils.clip_grads_with_norm_(b, float(norm) / 3, norm)
        opt_b.step()
    assert opt_a.kernel_steps == 4
    for x, y, s0 in zip(a, b, start):
        change = (y.float() - s0.float()).abs().max()
        assert change > 1e-3
        if dtype == torch.float32:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * float(change.detach()))
        else:  # bf16 storage: the two may round a value differently once per step, at the value's magnitude along
            # its path (a weight that crossed zero was rounded at its start's magnitude): 4 bf16 steps of the larger
            # of start and end, plus the steps' own movement (4 * lr) for weights that started near zero.
            bound = 4 * 2.0**-7 * (torch.maximum(y.float().abs(), s0.float().abs()) + 4 * KW["lr"])
            assert ((x.float() - y.float()).abs() <= bound).all(), (x.float() - y.float()).abs().max()
        # bf16: torch's clip pass rounds the scaled gradient to bf16 before its step, ours scales in fp32 inside the
        # kernel, and each stores v in bf16: the two may differ by a bf16 step (2^-7 relative at most) per step,
        # carried forward with weight beta2 -> at most 4 steps after 4 steps (the first H200 run saw 2.5%).
        torch.testing.assert_close(opt_a.state[x]["exp_avg_sq"].float(), opt_b.state[y]["exp_avg_sq"].float(),
                                   rtol=4 * 2.0**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA GPU")
def test_gpu_gated_steps_equal_the_kept_steps_alone():
    """Gated steps (launched before the guard's host read) with gates 1, 0, 1: bit-equal to two ungated steps."""
    sizes = ((4096, 1000), (7,), (3, 5000))
    g = torch.Generator().manual_seed(1)
    a = [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", torch.bfloat16)) for s in sizes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = ChunkedAdamW(a, fused=True, **KW), ChunkedAdamW(b, fused=True, **KW)
    seq = [[torch.randn(p.shape, generator=g).to("cuda", p.dtype) for p in a] for _ in range(3)]
    for grads, gate in zip(seq, (1.0, 0.0, 1.0)):
        for p, gr in zip(a, grads):
            p.grad = gr.clone()
        norm = norm_of(grads).cuda()
        gate_t = torch.tensor(gate, device="cuda")
        torch.cuda.synchronize()
        # Launched before the guard's host read, it must not wait for the GPU itself (on the H200 the step
        # counts' _foreach_add_ with a 0-d CUDA tensor did): no synchronising call once the kernel is compiled.
        torch.cuda.set_sync_debug_mode("error" if opt_a.kernel_steps else "default")
        try:
            assert opt_a.clip_and_step(norm, 1.0, gate=gate_t)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if gate:
            for q, gr in zip(b, grads):
                q.grad = gr.clone()
            opt_b.clip_and_step(norm, 1.0)
    for x, y in zip(a, b):
        assert torch.equal(x, y) and opt_a.state[x]["step"].item() == 2.0
        assert torch.equal(opt_a.state[x]["exp_avg"], opt_b.state[y]["exp_avg"])
