"""The memory plan's fp8 weight copies: which FP8 layers keep an fp8 copy of their weight for backward under each
parallel layout and precision setting (orchestration.training.model_setup.fp8_weight_copy_layers), and, on two gloo
workers built by the product's build_training_model, that the bytes planned are the bytes the forward leaves alive."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from models.planning import fp8_weight_copy_bytes
from models.registry import build_model
from orchestration.machine_defaults import Machine
from orchestration.training.model_setup import fp8_weight_copy_layers, plan_fp8
from tests.spawned import free_port, rank_process_group
from tests.test_machine_defaults import resolve

CPU = Machine()  # no GPU: CPU workers, every eligible layer converted (no size rule)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _copy_layers(world: int, *overrides: str) -> tuple[list[str], list[str], tuple[str, ...]]:
    """(the converted linears, the converted expert groups, the layers that keep a copy at this world size)."""
    job, _ = resolve(CPU, "model=debug_moe", "precision=fp8", "precision.compute_dtype=bfloat16", *overrides,
                     enforce=False)
    model = build_model(job.model.name, device="meta")
    converted = plan_fp8(job, on_gpu=False, model=model).converted
    linears = [n for n in converted if isinstance(model.get_submodule(n), torch.nn.Linear)]
    experts = [n for n in converted if n not in linears]
    return linears, experts, fp8_weight_copy_layers(job, world, converted, model)


def test_one_worker_keeps_every_fp8_weight_and_the_float32_experts():
    linears, experts, keep = _copy_layers(1)
    assert linears and experts and "output" in linears
    assert set(keep) == set(linears) | set(experts)


def test_fsdp_with_the_fp8_all_gather_keeps_only_the_heads_and_no_bf16_gathered_experts():
    linears, experts, keep = _copy_layers(2)
    assert len(linears) > 1 and experts and keep == ("output",)


def test_fsdp_without_the_fp8_all_gather_keeps_every_linear_and_a_float32_gather_keeps_the_experts():
    linears, experts, keep = _copy_layers(2, "precision.fp8_all_gather=false")
    assert set(keep) == set(linears)
    _, _, keep = _copy_layers(2, "precision.fsdp_param_dtype=float32")
    assert set(keep) == {"output", *experts}


def test_expert_parallel_experts_stay_float32_and_keep_their_copies():
    linears, experts, keep = _copy_layers(2, "train.expert_parallel=2")
    assert len(linears) > 1 and set(keep) == {"output", *experts}


def test_float32_compute_keeps_no_expert_copy():
    linears, experts, keep = _copy_layers(1, "precision.compute_dtype=float32")
    assert experts and set(keep) == set(linears)


def _measured_worker(rank: int, world: int, port: int, out: str, overrides: list[str]) -> None:
    from orchestration.training.model_setup import build_training_model

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        job, _ = resolve(CPU, "model=debug_moe", "precision=fp8", "precision.compute_dtype=bfloat16", *overrides,
                         enforce=False)
        model = build_training_model(job, world_size=world, device=torch.device("cpu")).model
        meta = build_model(job.model.name, device="meta")
        shapes = set()
        for p in meta.parameters():
            if p.dim() >= 2:
                shapes |= {tuple(p.shape), (*p.shape[:-2], p.shape[-1], p.shape[-2])}
        saved = []

        def pack(t):
            if t.dtype in FP8_DTYPES and tuple(t.shape) in shapes:
                saved.append(t)
            return t

        tokens = torch.randint(0, 256, (3, 41), generator=torch.Generator().manual_seed(rank))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        # What is alive when the forward ends (the peak's moment without checkpointing): FSDP2 has freed the buffers
        # it gathered, fp8 ones included (their storage is resized to 0 until backward gathers them again).
        alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        converted = plan_fp8(job, on_gpu=False, model=meta).converted
        planned = fp8_weight_copy_bytes(meta, fp8_weight_copy_layers(job, world, converted, meta), checkpointing=False)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"measured": sum(alive.values()), "planned": planned, "saved": len(saved)}, f)


@pytest.mark.parametrize("overrides", [[], ["precision.fp8_all_gather=false"]], ids=["fp8_gather", "bf16_gather"])
def test_planned_fp8_copies_are_what_two_fsdp_workers_keep_alive_after_the_forward(tmp_path, overrides):
    out = str(tmp_path / "copies.json")
    mp.spawn(_measured_worker, args=(2, free_port(), out, overrides), nprocs=2, join=True)
    with open(out) as f:
        got = json.load(f)
    assert got["saved"] > 0 and got["planned"] > 0
    assert got["measured"] == got["planned"], got
