"""The worker's gradient norm and clipping (orchestration.training.distributed.local_grad_norm, global_grad_norm,
clip_grads_with_norm_): the same norm and clipped gradients as torch.nn.utils.clip_grad_norm_, on one process and
under FSDP2 on two (gloo, CPU), from one pass over the gradients instead of two."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from orchestration.training.distributed import global_grad_norm, local_grad_norm
from tests.spawned import rank_process_group


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 40), nn.GELU(), nn.Linear(40, 8))


def _backward(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 24, generator=g), torch.randn(32, 8, generator=g)
    (10 * (model(x) - y).square().mean()).backward()  # scaled so the norm is well above the clip threshold


def test_one_process_matches_clip_grad_norm():
    ref, ours = _model(), _model()
    _backward(ref)
    _backward(ours)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    norm = global_grad_norm(local_grad_norm(ours, torch.device("cpu")), world_size=1, sharding="fsdp")
    torch.nn.utils.clip_grads_with_norm_(ours.parameters(), 1.0, norm)
    assert ref_norm.item() > 1.0  # clipping really happened
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p_ref, p in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-6, atol=1e-7)


def _run_rank(rank: int, world: int, init_file: str, result_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with rank_process_group("gloo", f"file://{init_file}", rank, world):
        ref = _model()
        sharded = copy.deepcopy(ref)
        # A CPU mesh: fully_shard's default mesh is on the accelerator whenever one is visible (a GPU machine)
        mesh = init_device_mesh("cpu", (world,))
        for layer in sharded:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        # Every rank the same batch: FSDP's averaged gradient is then the one-process gradient.
        _backward(ref)
        _backward(sharded)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        local = local_grad_norm(sharded, torch.device("cpu"))
        norm = global_grad_norm(local, world_size=world, sharding="fsdp")
        torch.nn.utils.clip_grads_with_norm_(sharded.parameters(), 1.0, norm)
        full_grads = [p.grad.full_tensor() for p in sharded.parameters()]
        if rank == 0:
            out = {}
            out["ref_norm"], out["norm"], out["local"] = ref_norm.item(), norm.item(), local.item()
            out["max_grad_err"] = max((g - p.grad).abs().max().item()
                                      for g, p in zip(full_grads, ref.parameters(), strict=True))
            torch.save(out, result_file)


@pytest.mark.slow
def test_fsdp2_two_ranks_match_the_unsharded_norm(tmp_path):
    mp.spawn(_run_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=2, join=True)
    out = torch.load(tmp_path / "out.pt")
    assert out["ref_norm"] > 1.0
    assert out["local"] < out["norm"]  # rank 0 holds only part of the gradient
    assert out["norm"] == pytest.approx(out["ref_norm"], rel=1e-5)
    assert out["max_grad_err"] < 1e-6
