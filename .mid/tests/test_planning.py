"""Planning: counts from meta builds, FLOPs, bytes per worker arithmetic, activation estimate vs measurement."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from models.planning import (
    GIB,
    activation_bytes,
    count_params,
    fp8_weight_copy_bytes,
    plan_model,
    smallest_fitting_world_size,
)
from models.registry import build_model


def test_llama3_8b_plan_counts_flops_and_bytes():
    n = 8_030_261_248
    plan = plan_model("llama3_8b", world_size=8, seq_len=8192, micro_batch=1)
    assert plan.total_params == plan.active_params == n
    assert plan.embedding_params == 128256 * 4096
    # torchtitan's formula: 6 (N - embedding) + 12 L H C T.
    assert plan.flops_per_token == 6 * (n - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    shard = math.ceil(n / 8)
    mem = plan.bytes_per_worker
    assert (mem.params, mem.grads, mem.optimizer) == (shard * 4, shard * 4, shard * 8)  # fp32 params, AdamW m, v
    # bf16 parameters: half the params and grads, plus an fp32 master copy beside m and v.
    bf16 = plan_model("llama3_8b", world_size=8, seq_len=8192, micro_batch=1, param_dtype_bytes=2)
    assert (bf16.bytes_per_worker.params, bf16.bytes_per_worker.optimizer) == (shard * 2, shard * 12)
    # Per token and layer: norms 2 * 8 D, attention 4 * 2 * H C + 4 H, SwiGLU 4 * 2 F (bytes, bf16 compute).
    per_layer = 2 * 8 * 4096 + (4 * 2 * 4096 + 4 * 32) + 4 * 2 * 14336
    head = 8 * 4096 + 4 * 128256
    assert plan.activation_bytes_no_ac == 8192 * (32 * per_layer + head)
    assert plan.activation_bytes_ac == 8192 * (32 * 4096 * 2 + per_layer + head)
    assert mem.activations == plan.activation_bytes_no_ac and mem.total == sum(mem.to_dict().values()) - mem.total


def test_fits_and_reasons_against_memory():
    plan = plan_model("llama3_8b", world_size=8, seq_len=8192, micro_batch=1)
    assert 70 * GIB < plan.bytes_per_worker.total < 100 * GIB
    assert plan.fits(141 * GIB)  # an H200
    assert not plan.fits(80 * GIB)
    reasons = plan.fit_reasons(80 * GIB)
    assert reasons[0].startswith("does not fit") and any("activation_checkpointing=true" in r for r in reasons)
    ac = plan_model("llama3_8b", world_size=8, seq_len=8192, micro_batch=1, activation_checkpointing=True)
    assert ac.fits(80 * GIB) and ac.fit_reasons(80 * GIB)[0].startswith("fits")
    big = plan_model("llama3_70b", world_size=2, seq_len=8192, micro_batch=1, activation_checkpointing=True)
    assert not big.fits(141 * GIB)
    assert any("sharding over >=" in r for r in big.fit_reasons(141 * GIB))


def test_plan_is_json_serialisable_with_fits():
    plan = plan_model("debug_moe", world_size=2, seq_len=128, micro_batch=8)
    d = json.loads(json.dumps(plan.to_dict(memory_bytes_per_worker=24 * GIB)))
    assert d["fits"] is True and d["reasons"][0].startswith("fits")
    for key in ("model", "total_params", "active_params", "flops_per_token", "bytes_per_worker"):
        assert key in d
    assert set(d["bytes_per_worker"]) == {"params", "grads", "optimizer", "fsdp_buffers", "activations",
                                          "fp8_weight_copies", "total"}
    assert "fits" not in plan.to_dict()


def test_activation_checkpointing_and_micro_batch_scaling():
    p1 = plan_model("deepseek_moe16b", world_size=8, seq_len=4096, micro_batch=1)
    p2 = plan_model("deepseek_moe16b", world_size=8, seq_len=4096, micro_batch=2)
    assert p2.activation_bytes_no_ac == 2 * p1.activation_bytes_no_ac
    assert p1.activation_bytes_ac < p1.activation_bytes_no_ac / 5
    assert p1.active_params == 2_828_650_496 and p1.total_params == 16_375_728_128
    # FLOPs follow the active, not the total, parameters.
    assert 6 * (p1.active_params - p1.embedding_params) < p1.flops_per_token < 6 * p1.active_params * 1.5


def test_sharding_modes():
    kw = {"seq_len": 128, "micro_batch": 1}
    rep = plan_model("llama3_1b", world_size=8, sharding="replicate", **kw)
    fsdp = plan_model("llama3_1b", world_size=8, sharding="fsdp", **kw)
    hsdp = plan_model("llama3_1b", world_size=8, sharding="hsdp", shard_degree=4, **kw)
    assert rep.bytes_per_worker.params == 1_235_814_400 * 4 and rep.bytes_per_worker.fsdp_buffers == 0
    assert fsdp.bytes_per_worker.params == math.ceil(1_235_814_400 / 8) * 4
    assert hsdp.bytes_per_worker.params == math.ceil(1_235_814_400 / 4) * 4 and hsdp.shard_degree == 4
    assert fsdp.embedding_params == 0  # tied: the matrix is the output projection too
    with pytest.raises(ValueError, match="shard_degree"):
        plan_model("llama3_1b", world_size=8, sharding="hsdp", **kw)
    with pytest.raises(ValueError, match="sharding"):
        plan_model("llama3_1b", world_size=8, sharding="tp", **kw)
    with pytest.raises(ValueError, match="max_seq_len"):
        plan_model("debug_dense", world_size=1, seq_len=4096, micro_batch=1)


def test_smallest_fitting_world_size():
    kw = {"seq_len": 8192, "micro_batch": 1, "activation_checkpointing": True}
    ws = smallest_fitting_world_size("llama3_70b", 80 * GIB, max_world_size=64, **kw)
    assert ws is not None and 8 < ws <= 32
    assert plan_model("llama3_70b", world_size=ws, **kw).fits(80 * GIB)
    assert not plan_model("llama3_70b", world_size=ws - 1, **kw).fits(80 * GIB)
    assert smallest_fitting_world_size("llama3_70b", 8 * GIB, max_world_size=4, **kw) is None


def test_deepseek_v3_plan_on_meta():
    plan = plan_model("deepseek_v3", world_size=256, seq_len=4096, micro_batch=1, activation_checkpointing=True)
    assert abs(plan.total_params / 671e9 - 1) < 0.005 and abs(plan.active_params / 37e9 - 1) < 0.02
    assert plan.notes and "planning only" in plan.notes[0]


def _measured_saved_bytes(model, tokens) -> int:
    """Bytes of distinct storages autograd saves for backward in one training forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return sum(saved.values())


@pytest.mark.parametrize("name", ["debug_dense", "debug_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_matches_measured(name, dtype):
    model = build_model(name, "cpu", seed=0).to(dtype)
    tokens = torch.randint(0, 256, (4, 129))
    measured = _measured_saved_bytes(model, tokens)
    estimate = activation_bytes(model, 4 * 128, dtype.itemsize, checkpointing=False)
    # Measured 2026-12: estimate / measured = 0.99 to 1.03.
    assert abs(estimate / measured - 1) < 0.05, (estimate, measured)


def _measured_fp8_weight_copies(model, tokens) -> int:
    """Bytes of the distinct fp8 tensors shaped like an FP8 layer's weight (either layout) that autograd saves in one
    training forward under bf16 autocast: the weight copies FP8 layers keep for backward (activations have other
    shapes: 3 x 40 = 120 rows, no weight dim here)."""
    shapes = set()
    for p in model.parameters():
        if p.dim() >= 2:
            shapes |= {tuple(p.shape), (*p.shape[:-2], p.shape[-1], p.shape[-2])}
    saved = {}

    def pack(t):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and tuple(t.shape) in shapes:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return sum(saved.values())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("name", ["debug_dense", "debug_moe"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_fp8_weight_copies_match_what_fp8_layers_save(name, param_dtype, recipe):
    """The plan's fp8 weight copies are the bytes the converted layers save for backward: every FP8 linear's weight in
    fp8 in every recipe (tensorwise: as cast; rowwise: the column-scaled transposed copy; the head's too), and the experts' only where their weights are wider than the tokens (float32 master weights
    under bf16 autocast; bf16 weights, as FSDP2 gathers them, are kept as they are)."""
    import fp8

    model = build_model(name, "cpu", seed=0).to(param_dtype)
    fp8.convert_to_fp8(model, recipe, module_filter=fp8.convert.make_module_filter(output_head=True))
    names = list(fp8.precision_state(model)["modules"])
    experts = [n for n in names if not isinstance(model.get_submodule(n), torch.nn.Linear)]
    assert bool(experts) == (name == "debug_moe")
    tokens = torch.randint(0, 256, (3, 41))
    # Experts keep an fp8 copy only for float32 weights (orchestration.training.model_setup.fp8_weight_copy_layers).
    keep = [n for n in names if param_dtype == torch.float32 or n not in experts]
    expect = fp8_weight_copy_bytes(model, keep, checkpointing=False)
    assert expect > 0 and _measured_fp8_weight_copies(model, tokens) == expect


def test_plan_counts_fp8_weight_copies_and_activation_checkpointing_keeps_one_block():
    """Llama3-8B, 4 layers, on one worker: its FP8 linears' weights, 1 byte each, with no checkpointing; with it, the
    larger of one block's and the head's (the head's copy is freed before the first block's backward recomputes)."""
    model = build_model("llama3_8b", "meta", overrides={"n_layers": 4})
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    block = sum(model.get_submodule(n).weight.numel() for n in linears if n.startswith("layers.0."))
    head = model.output.weight.numel()
    assert block == 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 and head == 128256 * 4096
    for ac in (False, True):
        plain = plan_model("llama3_8b", world_size=1, seq_len=8192, micro_batch=1, overrides={"n_layers": 4},
                           activation_checkpointing=ac)
        plan = plan_model("llama3_8b", world_size=1, seq_len=8192, micro_batch=1, overrides={"n_layers": 4},
                          activation_checkpointing=ac, fp8_weight_copy_layers=linears)
        copies = plan.bytes_per_worker.fp8_weight_copies
        assert plain.bytes_per_worker.fp8_weight_copies == 0
        assert copies == (max(head, block) if ac else head + 4 * block)
        assert plan.bytes_per_worker.total == plain.bytes_per_worker.total + copies
    # The "would fit with checkpointing" reason counts the copies checkpointing leaves.
    assert plan.fp8_copy_bytes_no_ac == head + 4 * block and plan.fp8_copy_bytes_ac == max(head, block) == head


def test_count_params_active_for_moe():
    model = build_model("debug_moe")
    counts = count_params(model)
    routed_per_layer = 8 * 3 * 128 * 64
    assert counts.routed_experts == 2 * routed_per_layer
    assert counts.total - counts.active == 2 * routed_per_layer * 6 // 8  # 6 of 8 experts idle per token


@pytest.mark.parametrize("sharding, group", [("fsdp", 8), ("hsdp", 4), ("hsdp", 2)])
def test_the_launchers_plan_shards_the_states_as_the_layout_does(sharding, group):
    """The plan a launch checks (and the fewest-workers search and the micro-batch default, which share its helper)
    counts parameters, gradients and AdamW states over the layout's shard group: all 8 workers under FSDP, the group
    under HSDP. Llama3-8B's 8,030,261,248 float32 parameters: 4 bytes each, 4 for the gradient, 8 for AdamW."""
    from orchestration.driver.plan import build_job_plan
    from orchestration.machine_defaults import Machine
    from tests.test_machine_defaults import resolve

    extra = [f"train.shard_group_size={group}"] if sharding == "hsdp" else []
    job, notes = resolve(Machine(), "model=llama3_8b", "precision=fp8", "cluster.min_workers=8",
                         "cluster.max_workers=8", "train.global_batch_size=8", "train.micro_batch_size=1",
                         "data.seq_len=1024", f"train.sharding={sharding}", *extra, enforce=False)
    breakdown = build_job_plan(job, notes)["bytes_breakdown"]
    params = 8_030_261_248
    assert breakdown["params"] == pytest.approx(4 * params / group, rel=1e-3)
    assert breakdown["grads"] == pytest.approx(4 * params / group, rel=1e-3)
    assert breakdown["optimizer"] == pytest.approx(8 * params / group, rel=1e-3)
