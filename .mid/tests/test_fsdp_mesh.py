"""FSDP2 shards a gloo (CPU) job on a CPU mesh even where a GPU is visible.

fully_shard without a mesh builds its default one on the machine's accelerator whenever one is visible, whatever the
process group's backend: on the H100 machine a CPU job (and the CPU tests) then moved parameters to the GPU and handed
CUDA tensors to gloo, and rank 0 died with SIGSEGV. No GPU exists here, so the accelerator query is what is mocked:
it answers "cuda" as it does on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from tests.spawned import rank_process_group


def _rank(rank: int, world: int, init_file: str, result_file: str) -> None:
    from torch.distributed.tensor import DTensor

    from models.loss import model_lm_loss
    from models.registry import build_model
    from orchestration.training.distributed import parallelize

    torch._C._get_accelerator = lambda: torch.device("cuda")  # what a GPU machine's torch answers
    with rank_process_group("gloo", f"file://{init_file}", rank, world):
        torch.manual_seed(0)
        model = build_model("debug_dense", device="cpu", overrides={"n_layers": 2})
        model.init_weights(seed=0)
        sharded = parallelize(model, world, "fsdp", "float32", "float32")
        params = list(sharded.parameters())
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model_lm_loss(sharded, tokens, tokens, compiled=False)
        loss.backward()
        if rank == 0:
            torch.save({"mesh_types": sorted({p.device_mesh.device_type for p in params if isinstance(p, DTensor)}),
                        "devices": sorted({p.device.type for p in params}), "n": len(params),
                        "finite": bool(torch.isfinite(loss))}, result_file)


@pytest.mark.slow
def test_fsdp2_shards_a_gloo_job_on_the_cpu_when_a_gpu_is_visible(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=2, join=True)
    out = torch.load(tmp_path / "out.pt")
    assert out["n"] > 0 and out["mesh_types"] == ["cpu"] and out["devices"] == ["cpu"] and out["finite"]
