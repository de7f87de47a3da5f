"""The tensorwise FP8 weights' amax kept from one weight change to the next (fp8.weight_amax): written by
optim.ChunkedAdamW's kernel from the values it stores, reduced again after any other change, and read by the casts,
whose outputs must stay bit-equal to casting with the amax reduced at every forward.

The kernel cases run in the Triton interpreter (a child pytest, as in tests/test_adamw.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp8.head import Float8LMHead, fp8_linear_cross_entropy
from fp8.linear import Float8Linear
from fp8.reference import abs_amax
from optim import ChunkedAdamW
from optim import adamw as adamw_mod
from orchestration.training.optimizer import keep_weight_amax
from tests.interp_child import expose_or_run

KW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _layers(dtype=torch.float32, seed=0) -> nn.Sequential:
    """Three FP8 linears whose weights are 210, 192 and 320 elements: a partial last chunk of the kernel's small test
    chunk (64 elements) and exact ones; biases are parameters whose amax nobody keeps."""
    torch.manual_seed(seed)
    return nn.Sequential(Float8Linear(70, 3, dtype=dtype), Float8Linear(3, 64, bias=False, dtype=dtype),
                         Float8Linear(64, 5, dtype=dtype))


def _set_grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.shape, generator=g) * (1 + i)).to(p.dtype)


def _amaxes(model) -> list[torch.Tensor]:
    return [m.weight_amax.clone() for m in model if isinstance(m, Float8Linear)]


# ----------------------------------------------------------------------------- interpreter cases (child process)

@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(adamw_mod, "BLOCK", 64)
    monkeypatch.setattr(adamw_mod, "AMAX_SEGMENT_BLOCK", 2)  # several loads per weight in the reduction


def _interp_the_kernel_writes_the_amax_of_the_weights_it_stores(small_blocks):
    for dtype in (torch.float32, torch.bfloat16):
        model = _layers(dtype)
        kept, other = list(model)[:2], model[2]  # the last layer's amax is not asked for
        other.weight_amax.fill_(-1.0)
        opt = ChunkedAdamW(model.parameters(), **KW)
        opt.keep_weight_amax(kept)
        for step in range(3):
            _set_grads(list(model.parameters()), step)
            opt.clip_and_step(torch.tensor(5.0), 1.0)
            for layer in kept:
                # exactly max |w| of the weight as stored (bf16 weights: of the rounded values)
                assert torch.equal(layer.weight_amax, abs_amax(layer.weight)), (dtype, step)
            assert other.weight_amax.item() == -1.0
        assert opt.kernel_steps == 3


def _interp_a_gated_off_step_keeps_the_amax_and_a_nan_weight_gives_nan(small_blocks):
    model = _layers()
    layers = list(model)
    opt = ChunkedAdamW(model.parameters(), **KW)
    opt.keep_weight_amax(layers)
    _set_grads(list(model.parameters()), 0)
    opt.clip_and_step(torch.tensor(5.0), 1.0, gate=torch.tensor(1.0))
    before = _amaxes(model)
    weights = [m.weight.detach().clone() for m in layers]
    _set_grads(list(model.parameters()), 1)
    assert opt.clip_and_step(torch.tensor(5.0), 1.0, gate=torch.tensor(0.0))
    assert all(torch.equal(m.weight, w) for m, w in zip(layers, weights))  # nothing stepped...
    assert all(torch.equal(a, b) for a, b in zip(_amaxes(model), before))  # ...and the amax is still theirs
    grads = [torch.zeros_like(p) for p in model.parameters()]
    grads[0][1, 7] = float("nan")  # the first weight's element 77: its second chunk
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    opt.step()
    assert torch.isnan(layers[0].weight_amax) and torch.isnan(abs_amax(layers[0].weight))
    assert torch.equal(layers[1].weight_amax, abs_amax(layers[1].weight))


def _interp_after_kernel_steps_the_forward_reduces_nothing_and_matches_reducing(small_blocks):
    model = _layers()
    twin = copy.deepcopy(model)  # the same steps, its casts reducing the amax at every forward
    opt, opt_twin = ChunkedAdamW(model.parameters(), **KW), ChunkedAdamW(twin.parameters(), **KW)
    keeper = keep_weight_amax(model, opt)
    x = torch.randn(16, 70, generator=torch.Generator().manual_seed(3))
    for step in range(4):
        for net, o in ((model, opt), (twin, opt_twin)):
            loss = net(x).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert keeper.reductions == 3  # the first forward's: the kernel kept every later amax
        assert torch.equal(model(x), twin(x)), step
    assert all(m.weight_amax_of == "weight" for m in model) and not any(m.weight_amax_of for m in twin)


def _interp_fsdp2_fp8_all_gather_shards_keep_their_amax_through_kernel_steps(monkeypatch, tmp_path):
    """FSDP2 (one gloo rank) with the fp8 all-gather, stepped by the kernel: the all-gathers reduce each shard's amax
    once (the first), then take the kernel's, and the losses equal a twin whose all-gathers reduce every time."""
    monkeypatch.setattr(adamw_mod, "BLOCK", 4096)  # few interpreted programs for the model's ~250k elements
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp8
    from fp8.fsdp_allgather import enable_fp8_all_gather, track_fsdp_params
    from models.registry import build_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def sharded():
            model = build_model("debug_dense", device="cpu", overrides={"n_layers": 1}, seed=0)
            fp8.convert_to_fp8(model, "tensorwise")
            enable_fp8_all_gather(model)
            policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            track_fsdp_params(model)
            return model

        model, twin = sharded(), sharded()
        opt, opt_twin = ChunkedAdamW(model.parameters(), **KW), ChunkedAdamW(twin.parameters(), **KW)
        keeper = keep_weight_amax(model, opt)
        assert len(keeper.shard_layers) == 7 and not keeper.weight_layers  # the block's wq wk wv wo w1 w2 w3
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
        for step in range(2):
            losses = []
            for net, o in ((model, opt), (twin, opt_twin)):
                loss = net(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            assert losses[0] == losses[1], step
            assert keeper.reductions == 7, step  # the first forward's all-gathers only
        assert opt.kernel_steps == 2
    finally:
        dist.destroy_process_group()


N_INTERP_CASES = 4
expose_or_run(globals(), __file__, N_INTERP_CASES, "test_kernel_cases_in_the_triton_interpreter")


# ----------------------------------------------------------------------------- CPU cases


def test_the_tensorwise_cast_reads_the_kept_amax():
    """Kept and correct: the same bytes as reducing it; kept and too small: the weight saturates, other outputs (so it
    is what the cast read)."""
    torch.manual_seed(0)
    layer = Float8Linear(64, 32, recipe="tensorwise")
    x = torch.randn(8, 64)
    reduced = layer(x)
    layer.weight_amax_of = "weight"
    layer.weight_amax.copy_(abs_amax(layer.weight))
    assert torch.equal(layer(x), reduced)
    layer.weight_amax.mul_(0.25)
    assert not torch.allclose(layer(x), reduced, rtol=0.01)
    rowwise = Float8Linear(64, 32, recipe="rowwise")
    rowwise.weight_amax_of = "weight"  # only tensorwise casts take one amax: a rowwise layer ignores it
    rowwise.weight_amax.fill_(1e-9)
    assert rowwise.kept_weight_amax() is None


def test_the_fused_fp8_head_reads_the_kept_amax():
    torch.manual_seed(0)
    head = Float8LMHead(64, 96, bias=False, recipe="tensorwise")
    x, targets = torch.randn(16, 64), torch.randint(0, 96, (16,))
    reduced = fp8_linear_cross_entropy(head, x, targets)
    head.weight_amax_of = "weight"
    head.weight_amax.copy_(abs_amax(head.weight))
    assert torch.equal(fp8_linear_cross_entropy(head, x, targets), reduced)
    head.weight_amax.mul_(0.25)
    assert fp8_linear_cross_entropy(head, x, targets).item() != reduced.item()


def test_any_torch_change_of_a_weight_is_reduced_again_before_the_next_forward():
    """torch's AdamW (the CPU workers'), a checkpoint load or rollback, a copy into one weight, a weight given new
    storage: each changes what the forward casts, and the forward after it equals a twin that reduces every time."""
    model, x = _layers(), torch.randn(4, 70)
    twin = copy.deepcopy(model)
    opt, opt_twin = torch.optim.AdamW(model.parameters(), **KW), torch.optim.AdamW(twin.parameters(), **KW)
    keeper = keep_weight_amax(model, opt)

    def same(expected_reductions: int) -> None:
        assert torch.equal(model(x), twin(x))
        assert keeper.reductions == expected_reductions

    same(3)
    same(3)  # nothing changed: nothing reduced
    for net, o in ((model, opt), (twin, opt_twin)):
        net(x).sum().backward()
        o.step()
    same(6)  # torch's step wrote every weight
    saved = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        for net in (model, twin):
            net[1].weight.mul_(3)
    same(7)
    for net in (model, twin):
        net.load_state_dict(saved)  # a rollback
    same(10)
    for net in (model, twin):
        net[2].weight.data = net[2].weight.data * 5  # new storage, same version counter
    same(11)


def test_only_plain_tensorwise_weights_the_optimizer_steps_are_kept():
    model = nn.Sequential(Float8Linear(8, 8, recipe="tensorwise"), Float8Linear(8, 8, recipe="rowwise"),
                          Float8Linear(8, 8, recipe="tensorwise"), nn.Linear(8, 8))
    opt = torch.optim.AdamW([*model[0].parameters(), *model[1].parameters(), *model[3].parameters()], **KW)
    keeper = keep_weight_amax(model, opt)
    assert keeper.weight_layers == [model[0]] and not keeper.shard_layers  # model[2]'s weight: not the optimizer's
    assert [m.weight_amax_of for m in model[:3]] == ["weight", None, None]
    assert keep_weight_amax(nn.Sequential(nn.Linear(4, 4)), torch.optim.AdamW(nn.Linear(4, 4).parameters())) is None


def test_the_worker_step_loses_nothing_with_the_amax_kept(monkeypatch):
    """The product's own build, optimizer and train_step (debug_dense, FP8 tensorwise with its fused head, on CPU):
    three steps' losses bit-equal to the same run with the amax reduced at every cast."""
    import orchestration.training.optimizer as optimizer_mod
    from orchestration.config import JobConfig, ModelConfig, MonitorConfig, PrecisionConfig, TrainConfig
    from orchestration.divergence.guard import StepGuard
    from orchestration.training.model_setup import build_training_model
    from orchestration.training.optimizer import make_optimizer
    from orchestration.training.step import MicroBatch, StepModel, train_step
    from orchestration.validation import validate

    def losses(keep: bool) -> tuple[list[float], list[bool]]:
        job = JobConfig(model=ModelConfig(name="debug_dense"),
                        precision=PrecisionConfig(name="fp8", recipe="tensorwise", fp8_output_head=True),
                        train=TrainConfig(global_batch_size=2, micro_batch_size=2, sharding="none"),
                        monitor=MonitorConfig())
        job.data.seq_len = 32
        validate(job)
        device = torch.device("cpu")
        torch.manual_seed(job.train.seed)
        model, recipe = build_training_model(job, 1, device)[:2]
        if not keep:
            monkeypatch.setattr(optimizer_mod, "keep_weight_amax", lambda model, optimizer: None)
        optimizer = make_optimizer(job, device, model)
        monkeypatch.undo()
        sm = StepModel(model, optimizer, device, torch.bfloat16, False, False, 1, "none", job.train.grad_clip)
        guard = StepGuard(job.monitor, model, fp8_run=recipe is not None)
        g = torch.Generator().manual_seed(0)
        out = []
        for step in range(3):
            tokens = torch.randint(0, model.args.vocab_size, (2, 33), generator=g)
            result = train_step(sm, [MicroBatch(tokens[:, :-1], tokens[:, 1:], 1.0, 1.0)], step, guard)
            assert result.updated
            out.append(float(result.loss))
        return out, [m.weight_amax_of == "weight" for m in model.modules() if isinstance(m, Float8Linear)]

    kept, kept_flags = losses(True)
    reduced, reduced_flags = losses(False)
    assert kept == reduced
    assert kept_flags and all(kept_flags) and not any(reduced_flags)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA GPU")
def test_gpu_kernel_keeps_the_amax_and_the_compiled_casts_match_reducing():
    """On the GPU at the dense model's sizes (4096-wide float32 weights: 32768 chunks each), each layer compiled as
    the worker compiles its blocks (the model's own pre-hook runs eagerly): the kernel's amax is the weight's,
    gated-off steps keep it, and the compiled FP8 forward and backward equal a twin whose casts reduce the amax."""
    torch.manual_seed(0)
    model = nn.Sequential(Float8Linear(4096, 4096, bias=False), Float8Linear(4096, 1024, bias=False)).cuda()
    twin = copy.deepcopy(model)
    opt, opt_twin = ChunkedAdamW(model.parameters(), **KW), ChunkedAdamW(twin.parameters(), **KW)
    keeper = keep_weight_amax(model, opt)
    for layer in (*model, *twin):
        layer.compile()
    x = torch.randn(2048, 4096, device="cuda")
    for step in range(4):
        gate = torch.tensor(0.0 if step == 2 else 1.0, device="cuda")
        outs = []
        for net, o in ((model, opt), (twin, opt_twin)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = net(x)
            y.float().square().mean().backward()
            outs.append(y.detach())
            assert o.clip_and_step(torch.tensor(1.0, device="cuda"), 1.0, gate=gate)
            o.zero_grad(set_to_none=True)
        assert torch.equal(outs[0], outs[1]), step
        for layer in model:
            assert torch.equal(layer.weight_amax, abs_amax(layer.weight)), step
    assert keeper.reductions == 2 and opt.kernel_steps == 4
