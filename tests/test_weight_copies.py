"""fp8.weight_copies: the GEMMs read compute copies made once per weight change, with the numerics of casting at every
use, and every way a weight changes refreshes them (in place by torch, the fused AdamW's launch, a checkpoint load or
rollback, a precision switch, a checkpoint from FSDP2 ranks loaded at another world size).

Each "refresh" test would fail with a stale copy: the model with copies is compared bit for bit with the same model
without them (which casts its master weights at every use) after the change. The fused AdamW cases run its kernel in
the Triton interpreter in a child pytest (tests/interp_child.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import fp8
from fp8.compute_weight import COPY_ATTR, CopyReadingLinear
from fp8.weight_copies import attach_weight_copies, copy_bytes, weight_copies
from models.loss import model_lm_loss
from models.registry import build_model
from optim import ChunkedAdamW
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.training.step import MicroBatch, StepModel, train_step
from tests.interp_child import expose_or_run
from tests.spawned import free_port, rank_process_group

BF16 = torch.bfloat16
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


# Half the debug flavors' width: the FP8 layers' sizes stay multiples of 16, the interpreter has fewer programs to run.
SMALL = {"debug_moe": {"dim": 64, "inter_dim": 128, "moe_inter_dim": 32}, "debug_dense": {"dim": 64}}


def build(name: str = "debug_moe", recipe: str | None = "tensorwise", copies: bool = True, seed: int = 0,
          device: str = "cpu"):
    model = build_model(name, device=device, overrides=SMALL[name], seed=seed)
    if recipe is not None:
        fp8.convert_to_fp8(model, recipe, module_filter=fp8.convert.make_module_filter(output_head=True))
    if copies:
        assert attach_weight_copies(model, BF16) is not None
    return model


def tokens(seed: int = 1, batch: int = 2, seq: int = 33) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model: nn.Module, seed: int = 1) -> float:
    t = tokens(seed)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return model_lm_loss(model, t[:, :-1], t[:, 1:], compiled=False).item()


def loss_and_grads(model: nn.Module) -> tuple[float, dict]:
    t = tokens()
    with torch.autocast("cpu", dtype=BF16):
        loss = model_lm_loss(model, t[:, :-1], t[:, 1:], compiled=False)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    """One optimizer step of the product's train_step (bf16 autocast, clip, AdamW); returns its loss."""
    sm = StepModel(model, opt, torch.device("cpu"), BF16)
    t = tokens(seed)
    return train_step(sm, [MicroBatch(t[:, :-1], t[:, 1:], 1.0, 1.0)], step=seed).loss.item()


def zero_masters_unseen(model: nn.Module) -> None:
    """Zero every copied master through .data (its own version counter: the copies cannot see it). A GEMM that read a
    master would now see zeros."""
    for e in weight_copies(model).entries:
        e.master.data.zero_()


@pytest.mark.parametrize(("name", "recipe"), [("debug_moe", None), ("debug_moe", "tensorwise"),
                                              ("debug_moe", "rowwise"), ("debug_dense", "tensorwise")])
def test_copies_give_the_numerics_of_casting_at_every_use(name, recipe):
    loss_c, grads_c = loss_and_grads(build(name, recipe, copies=True))
    loss_m, grads_m = loss_and_grads(build(name, recipe, copies=False))
    assert loss_c == loss_m
    assert grads_c.keys() == grads_m.keys()
    for n in grads_m:
        assert grads_c[n].dtype == torch.float32 and torch.equal(grads_c[n], grads_m[n]), n
    # ... and every GEMM weight the copies cover was read from its copy, not cast from the master again.
    model = build(name, recipe, copies=True)
    before = loss_of(model)
    zero_masters_unseen(model)
    assert loss_of(model) == before


def test_which_weights_get_copies():
    model = build("debug_moe", "tensorwise")
    copied = {(type(e.module).__name__, e.name, e.kind) for e in weight_copies(model).entries}
    assert ("GroupedExperts", "w13", "grouped") in copied and ("GroupedExperts", "w2", "grouped") in copied
    assert ("Float8LMHead", "weight", "linear") in copied and ("Float8Linear", "weight", "linear") in copied
    # Routers compute in float32 from the master: no copy. Embeddings are looked up, not multiplied: none either.
    for moe in model.moe_layers():
        assert not hasattr(moe.gate.weight, COPY_ATTR) and type(moe.gate) is nn.Linear
    assert not hasattr(model.tok_embeddings.weight, COPY_ATTR)
    # A plain linear (kept in bf16) reads its copy through CopyReadingLinear.
    bf16_model = build("debug_moe", None)
    assert type(bf16_model.layers["0"].attention.wq) is CopyReadingLinear
    # Nothing to copy where the compute dtype is the masters' own; attaching twice is refused.
    assert attach_weight_copies(build("debug_dense", None, copies=False), torch.float32) is None
    with pytest.raises(ValueError, match="already attached"):
        attach_weight_copies(model, BF16)


@pytest.mark.parametrize("recipe", [None, "tensorwise", "rowwise"])
def test_copy_bytes_is_what_attach_allocates(recipe):
    model = build("debug_moe", recipe)
    allocated = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                    if n.endswith(("_compute", "_fp8", "_fp8_scale", "_fp8_t", "_fp8_scale_t")))
    meta = build("debug_moe", recipe, copies=False, device="meta")
    assert copy_bytes(meta, BF16) == allocated
    copied = sum(e.master.numel() for e in weight_copies(model).entries)
    fp8_copied = sum(e.master.numel() for e in weight_copies(model).entries if e.kind)
    assert allocated >= 2 * copied + 2 * fp8_copied and (recipe is None) == (fp8_copied == 0)


def test_in_place_changes_refresh_the_copies():
    # Any in-place torch op on a master (a load, an import, torch's AdamW) moves its version counter.
    with_copies, plain = build(), build(copies=False)
    assert loss_of(with_copies) == loss_of(plain)
    with torch.no_grad():
        for m in (with_copies, plain):
            for p in m.parameters():
                if p.dim() >= 2:
                    p.mul_(-1.5)
    assert loss_of(with_copies) == loss_of(plain)
    assert weight_copies(with_copies).refreshes > len(weight_copies(with_copies).entries)  # attach + this change


def test_training_with_torch_adamw_and_a_precision_round_trip_matches_casting():
    # torch's AdamW (CPU) changes the masters in place: the copies follow every step; a BF16 fallback and the return
    # to FP8 read current fp8 operands (they were kept current while the model computed in bf16).
    a, b = build(), build(copies=False)
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), **ADAMW), torch.optim.AdamW(b.parameters(), **ADAMW)
    for s, precision in enumerate(["fp8", "bf16", "bf16", "fp8"]):
        fp8.set_precision(a, precision)
        fp8.set_precision(b, precision)
        assert step(a, opt_a, s) == step(b, opt_b, s), s
    assert loss_of(a) == loss_of(b)


def test_checkpoint_load_and_rollback_refresh_the_copies(tmp_path):
    a = build()
    opt = torch.optim.AdamW(a.parameters(), **ADAMW)
    mgr = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1)
    step(a, opt, 0)
    mgr.save(1, a, opt)
    step(a, opt, 1)
    step(a, opt, 2)
    # The rollback: step 1's weights back into the trained model, whose copies hold step 3's.
    mgr.load(mgr.latest(), a, opt)
    # The resume: a freshly initialised model (another seed) with copies, and the reference without any.
    resumed, reference = build(seed=5), build(seed=5, copies=False)
    for m in (resumed, reference):
        mgr.load(mgr.latest(), m, torch.optim.AdamW(m.parameters(), **ADAMW))
    assert loss_of(a) == loss_of(resumed) == loss_of(reference)
    assert loss_of(build(seed=5, copies=False)) != loss_of(reference)  # the load changed something


# ----------------------------------------------------------------------------- FSDP2 ranks (gloo) -> one rank

def _fsdp_worker(rank: int, world: int, port: int, root: str) -> None:
    from orchestration.training.distributed import init_weights_by_unit, parallelize

    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        model = build(copies=False, device="meta")
        template = build(copies=False, device="meta")
        model = parallelize(model, world, "fsdp", "bfloat16", "float32", fp8_all_gather=True)
        init_weights_by_unit(model, template, seed=0, device=torch.device("cpu"))
        # Sharded weights get no copies: FSDP2's all-gather makes their compute copies (the fp8 one from the global
        # amax that a shard's copy could not know).
        assert attach_weight_copies(model, BF16) is None
        assert not any(hasattr(p, COPY_ATTR) for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        t = tokens(rank)
        sm = StepModel(model, opt, torch.device("cpu"), BF16, world_size=world, sharding="fsdp")
        train_step(sm, [MicroBatch(t[:, :-1], t[:, 1:], 0.5, 1.0)], step=0)
        CheckpointManager(root, rank=rank, world_size=world).save(1, model, opt)


def test_fsdp2_checkpoint_loaded_at_world_size_one_refreshes_the_copies(tmp_path):
    # The elastic shrink: a checkpoint of 2 FSDP2 ranks (FP8 all-gather on) resumed by one unsharded worker.
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    one, reference = build(seed=3), build(seed=3, copies=False)
    for m in (one, reference):
        mgr.load(mgr.latest(), m, torch.optim.AdamW(m.parameters(), **ADAMW))
    assert loss_of(one) == loss_of(reference) != loss_of(build(seed=3, copies=False))


# ----------------------------------------------------------------------------- on a GPU (skipped without CUDA)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_compiled_worker_model_reads_copies_the_kernel_wrote(monkeypatch, precision):
    # The worker's model on the GPU (compiled blocks, ChunkedAdamW): after each step every copy is torch's cast of
    # its updated master and every fp8 operand what the layer's casts make of the copy, bit for bit; no master was
    # cast again by torch (the kernel wrote every copy); the compiled MoE blocks' grouped GEMMs found their operands.
    from fp8 import grouped
    from fp8.weight_copies import _grouped_operands, _linear_operands
    from orchestration.training.model_setup import build_training_model
    from orchestration.training.optimizer import make_optimizer
    from orchestration.validation import load_job_config

    found = {"hit": 0, "miss": 0}
    lookup = grouped.grouped_fp8_operands

    def counting(w, dtype):
        ops = lookup(w, dtype)
        found["hit" if ops is not None else "miss"] += 1
        return ops

    monkeypatch.setattr(grouped, "grouped_fp8_operands", counting)
    job = load_job_config({"model": {"name": "debug_moe", "compile": True}, "precision": {"name": precision},
                           "cluster": {"min_workers": 1, "max_workers": 1, "device": "cuda"},
                           "train": {"global_batch_size": 2, "micro_batch_size": 2}})
    device = torch.device("cuda")
    model = build_training_model(job, world_size=1, device=device).model
    opt = make_optimizer(job, device, model.parameters())
    assert isinstance(opt, ChunkedAdamW)
    copies = weight_copies(model)
    made = copies.refreshes
    sm = StepModel(model, opt, device, BF16, compiled=True)
    for s in range(3):
        t = tokens(s, seq=65).to(device)
        assert torch.isfinite(train_step(sm, [MicroBatch(t[:, :-1], t[:, 1:], 1.0, 1.0)], step=s).loss)
        copies.sync()
        for e in copies.entries:
            assert torch.equal(e.copy, e.master.detach().to(BF16)), e.name
            if e.kind:
                want = _linear_operands(e.module, e.copy) if e.kind == "linear" else _grouped_operands(e.copy)
                got = (e.operands.data, e.operands.scale, e.operands.data_t, e.operands.scale_t)
                assert all(w is None and g is None or torch.equal(g, w) for g, w in zip(got, want)), e.name
    assert opt.kernel_steps == 3 and copies.refreshes == made
    if precision == "fp8":
        assert found["hit"] > 0 and found["miss"] == 0, found


# ----------------------------------------------------------------------------- the fused AdamW (interpreter)

@pytest.fixture
def few_programs(monkeypatch):
    # The interpreter's cost grows with the number of programs: larger chunks, fewer programs.
    from optim import adamw as adamw_mod

    monkeypatch.setattr(adamw_mod, "BLOCK", 4096)


def _interp_fused_adamw_writes_the_copies_and_the_fp8_operands_follow(few_programs):
    # The kernel writes each bf16 copy beside its master and bumps the copy's version; the fp8 operands are then
    # re-made from the copy before the next forward. Bit-equal to the same kernel on a model without copies, over a
    # BF16 fallback and back.
    a, b = build("debug_moe", "rowwise"), build("debug_moe", "rowwise", copies=False)
    opt_a, opt_b = ChunkedAdamW(a.parameters(), **ADAMW), ChunkedAdamW(b.parameters(), **ADAMW)
    copies = weight_copies(a)
    made = copies.refreshes
    for s, precision in enumerate(["fp8", "bf16", "fp8"]):
        fp8.set_precision(a, precision)
        fp8.set_precision(b, precision)
        assert step(a, opt_a, s) == step(b, opt_b, s), s
    assert opt_a.kernel_steps == 3 and opt_b.kernel_steps == 3
    assert loss_of(a) == loss_of(b)
    # The kernel served: no master was cast again by torch, every fp8 operand was re-made from its written copy.
    assert copies.refreshes == made
    assert copies.fp8_refreshes == 3 * sum(1 for e in copies.entries if e.kind)
    for e in copies.entries:
        assert torch.equal(e.copy, e.master.detach().to(BF16))


N_INTERP_CASES = 1

expose_or_run(globals(), __file__, N_INTERP_CASES, "test_fused_adamw_cases_in_the_triton_interpreter")
