"""Unit-by-unit initialisation on the device (orchestration.training.distributed.init_weights_by_unit, what the worker uses):
the weights are exactly `init_weights(seed)`'s, unsharded or sharded by FSDP2 over two gloo ranks, FP8-converted
and activation-checkpointed, and no full copy of the model is ever built (the template stays on meta)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp

import fp8
from models.registry import build_model
from orchestration.training.distributed import init_weights_by_unit, parallelize
from tests.spawned import rank_process_group

SEED = 5


def _reference(name: str) -> dict[str, torch.Tensor]:
    """The model initialised whole on the CPU, FP8-converted after init (conversion keeps the parameters)."""
    ref = build_model(name, device="cpu")
    ref.init_weights(seed=SEED)
    fp8.convert_to_fp8(ref, "rowwise", module_filter=fp8.convert.make_module_filter())
    return {k: v.clone() for k, v in ref.state_dict().items()}


def _meta_model(name: str):
    model = build_model(name, device="meta")
    fp8.convert_to_fp8(model, "rowwise", module_filter=fp8.convert.make_module_filter())
    return model, copy.deepcopy(model)


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        k = k.replace("_checkpoint_wrapped_module.", "")
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


@pytest.mark.parametrize("name", ["debug_dense", "debug_moe"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_process_gives_init_weights_exactly(name, checkpointing):
    expected = _reference(name)
    model, template = _meta_model(name)
    model = parallelize(model, 1, "fsdp", "float32", "float32", activation_checkpointing=checkpointing)
    init_weights_by_unit(model, template, SEED, torch.device("cpu"))
    got = _full_state(model)
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    # The RoPE tables (non-persistent buffers) are computed, not garbage.
    ref = build_model(name, device="cpu")
    assert torch.equal(model.rope_cos, ref.rope_cos) and torch.equal(model.rope_sin, ref.rope_sin)
    # The template is back on meta: nothing of the full model stays allocated.
    assert {t.device.type for t in [*template.parameters(), *template.buffers()]} == {"meta"}
    assert all(not m.fp8_health_stats.any() for m in model.modules() if hasattr(m, "fp8_health_stats"))


def test_another_seed_gives_other_weights_and_units_differ():
    model, template = _meta_model("debug_dense")
    init_weights_by_unit(model, template, SEED + 1, torch.device("cpu"))
    expected = _reference("debug_dense")
    got = _full_state(model)
    assert not torch.equal(got["layers.0.attention.wq.weight"], expected["layers.0.attention.wq.weight"])
    # Two blocks of the same shape draw from different seeds.
    assert not torch.equal(got["layers.0.attention.wq.weight"], got["layers.1.attention.wq.weight"])


def _run_rank(rank: int, world: int, name: str, init_file: str, result_file: str) -> None:
    with rank_process_group("gloo", f"file://{init_file}", rank, world):
        model, template = _meta_model(name)
        model = parallelize(model, world, "fsdp", "float32", "float32")
        init_weights_by_unit(model, template, SEED, torch.device("cpu"))
        local_rows = model.layers["0"].attention.wq.weight.to_local().shape[0]
        state = _full_state(model)
        if rank == 0:
            torch.save({"state": state, "local_rows": local_rows}, result_file)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["debug_dense", "debug_moe"])
def test_fsdp2_two_ranks_give_the_same_weights(tmp_path, name):
    mp.spawn(_run_rank, args=(2, name, str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=2, join=True)
    out = torch.load(tmp_path / "out.pt")
    expected = _reference(name)
    assert out["local_rows"] * 2 == expected["layers.0.attention.wq.weight"].shape[0]  # really sharded
    assert out["state"].keys() == expected.keys()
    assert [k for k in expected if not torch.equal(out["state"][k], expected[k])] == []


def _run_unsharded_rank(rank: int, world: int, init_file: str, result_file: str) -> None:
    from orchestration.training.distributed import broadcast_from_rank0_if_unsharded

    with rank_process_group("gloo", f"file://{init_file}", rank, world):
        model, template = _meta_model("debug_moe")
        init_weights_by_unit(model, template, SEED + rank, torch.device("cpu"))  # replicas that start apart
        model.layers["1"].moe.expert_bias.fill_(float(rank))  # a persistent buffer apart too
        before = _full_state(model)
        broadcast_from_rank0_if_unsharded(model, world, "fsdp")  # sharded: each rank's shard is its own business
        untouched = all(torch.equal(before[k], v) for k, v in _full_state(model).items())
        broadcast_from_rank0_if_unsharded(model, world, "none")
        torch.save({"state": _full_state(model), "untouched": untouched}, f"{result_file}.{rank}")


@pytest.mark.slow
def test_unsharded_replicas_all_become_rank_0s(tmp_path):
    mp.spawn(_run_unsharded_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0["untouched"] and r1["untouched"]
    assert [k for k in r0["state"] if not torch.equal(r0["state"][k], r1["state"][k])] == []
    # rank 1 now holds rank 0's initialisation (seed SEED), not its own (SEED + 1)
    expected = _reference("debug_moe")
    # (the expert_bias rank 1 had filled with 1.0 is rank 0's 0.0 again)
    assert [k for k in expected if not torch.equal(r1["state"][k], expected[k])] == []
