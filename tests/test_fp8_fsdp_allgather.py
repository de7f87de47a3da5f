"""FP8 all-gather under FSDP2 (fp8/fsdp_allgather.py) on 2 and 4 gloo processes.

The reference is the same model under FSDP2 without it: the weight is all-gathered in high precision, and the layer
then casts the whole weight with its own (global) scale. The fp8 all-gather casts each shard with the all-reduced
scale, which is that same scale, and the cast is elementwise: losses, gradient shards and the weights after optimizer
steps must be bit-equal, in fp8, after the BF16 fallback (fp8.set_precision) and back. The bytes each all-gather moves
are counted on the real collective (torch.distributed's all-gather entry points, wrapped while the test runs).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Self

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orchestration.training.optimizer import keep_weight_amax
from tests.spawned import free_port, rank_process_group

FLAVOR = "debug_dense"
OVERRIDES = {"n_layers": 2}
SEQ, BATCH = 32, 2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class GatherBytes:
    """Counts the bytes each rank sends through torch.distributed's all-gathers (FSDP2 uses one per unsharded
    module), by wrapping the collective functions FSDP2 calls."""

    NAMES = ("all_gather_into_tensor", "all_gather_single")

    def __init__(self) -> None:
        self.per_call: list[int] = []
        self._orig = {}

    def __enter__(self) -> Self:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def counting(output_tensor, input_tensor, *args, _fn=fn, **kwargs):
                self.per_call.append(input_tensor.numel() * input_tensor.element_size())
                return _fn(output_tensor, input_tensor, *args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def take(self) -> list[int]:
        out, self.per_call = self.per_call, []
        return out


def _build_pair(mesh, param_dtype: torch.dtype):
    """(model with the fp8 all-gather, reference without), same weights, each block and the root sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp8
    from fp8.fsdp_allgather import enable_fp8_all_gather, track_fsdp_params
    from models.registry import build_model

    base = build_model(FLAVOR, device="cpu", overrides=OVERRIDES, seed=0)
    fp8.convert_to_fp8(base, "tensorwise")
    ref = copy.deepcopy(base)
    wrapped = enable_fp8_all_gather(base)
    assert len(wrapped) == 7 * OVERRIDES["n_layers"], wrapped  # wq wk wv wo w1 w2 w3 per block
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for m in (base, ref):
        for block in m.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(m, mesh=mesh, mp_policy=policy)
    assert track_fsdp_params(base) == len(wrapped)
    return base, ref


def _local(t: torch.Tensor) -> torch.Tensor:
    from fp8.fsdp_allgather import Fp8AllGatherWeight

    t = getattr(t, "_local_tensor", t)
    return t.hp if isinstance(t, Fp8AllGatherWeight) else t


def _step_both(model, ref, opts, tokens, counter, counted: str, set_precision) -> dict:
    """One training step of the fp8-gather model and of its reference on the same tokens (set_precision(m) first):
    each model's loss and what `counter` recorded during its forward and backward (row key `<label>_<counted>`),
    then which gradients and which weights after AdamW differ between the two."""
    row: dict = {}
    grads = {}
    for label, m, opt in (("fp8_gather", model, opts[0]), ("reference", ref, opts[1])):
        set_precision(m)
        loss = m(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        row[f"{label}_{counted}"] = counter.take()
        row[f"{label}_loss"] = loss.item()
        grads[label] = {n: _local(p.grad).clone() for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
    row["loss_equal"] = row["fp8_gather_loss"] == row["reference_loss"]
    row["grads_unequal"] = [n for n in grads["reference"]
                            if not torch.equal(grads["fp8_gather"][n], grads["reference"][n])]
    p1 = dict(model.named_parameters())
    row["weights_unequal"] = [n for n, p in ref.named_parameters() if not torch.equal(_local(p1[n]), _local(p))]
    return row


def _equivalence_worker(rank: int, world: int, port: int, out: str, param_dtype: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import fp8

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        model, ref = _build_pair(init_device_mesh("cpu", (world,)), _DTYPES[param_dtype])
        opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in (model, ref)]
        # The shards' amax kept as the worker keeps it (make_optimizer): torch's AdamW writes every shard, so each fp8
        # forward's all-gather reduces it again and the backward's re-gather reuses it.
        keeper = keep_weight_amax(model, opts[0])
        gen = torch.Generator().manual_seed(7)
        results = []
        # steps 0-1 fp8, 2-3 the BF16 fallback, 4 fp8 again
        schedule = ["fp8", "fp8", "bf16", "bf16", "fp8"]
        with GatherBytes() as counter:
            for step, precision in enumerate(schedule):
                tokens = torch.randint(0, 256, (world * BATCH, SEQ + 1), generator=gen)[rank * BATCH:(rank + 1) * BATCH]
                before = keeper.reductions
                row = _step_both(model, ref, opts, tokens, counter, "bytes",
                                 lambda m, precision=precision: fp8.set_precision(m, precision))
                results.append({"step": step, "precision": precision, **row,
                                "amax_reductions": keeper.reductions - before})
        expected = {**_expected_gather_bytes(model, world, param_dtype), "shards_kept": len(keeper.shard_layers)}
        with open(Path(out) / f"rank{rank}.json", "w") as f:
            json.dump({"steps": results, "expected": expected}, f)


def _expected_gather_bytes(model, world: int, param_dtype: str) -> dict:
    """Bytes per rank per all-gather of each FSDP unit (root first, then blocks), from the padded shard sizes:
    fp8 weights 1 byte per element, the rest in param_dtype."""
    from fp8.fsdp_allgather import is_fp8_all_gather_weight

    hp_bytes = _DTYPES[param_dtype].itemsize

    def unit_bytes(params, fp8_on: bool) -> int:
        total = 0
        for p in params:
            shard_numel = -(-p.shape[0] // world) * p[0].numel()
            total += shard_numel * (1 if fp8_on and is_fp8_all_gather_weight(p) else hp_bytes)
        return total

    root = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    blocks = [list(b.parameters()) for b in model.layers.values()]
    return {"fp8": [unit_bytes(root, True)] + [unit_bytes(b, True) for b in blocks],
            "hp": [unit_bytes(root, False)] + [unit_bytes(b, False) for b in blocks],
            "linear_weights_fp8": sum(unit_bytes([p for p in b if is_fp8_all_gather_weight(p)], True) for b in blocks),
            "linear_weights_hp": sum(unit_bytes([p for p in b if is_fp8_all_gather_weight(p)], False) for b in blocks)}


@pytest.mark.parametrize("world,param_dtype", [(2, "float32"), (4, "bfloat16")])
def test_fp8_all_gather_is_bit_equal_to_gathering_in_high_precision(tmp_path, world, param_dtype):
    mp.spawn(_equivalence_worker, args=(world, free_port(), str(tmp_path), param_dtype), nprocs=world, join=True)
    for rank in range(world):
        data = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected = data["expected"]
        for row in data["steps"]:
            assert row["loss_equal"], row
            assert row["grads_unequal"] == [], row
            assert row["weights_unequal"] == [], row
            # forward: root, block 0, block 1; backward re-gathers the blocks (resharded after forward), last first
            fwd_units, bwd_units = expected["fp8" if row["precision"] == "fp8" else "hp"], expected["hp"]
            want = fwd_units + fwd_units[-1:0:-1] if row["precision"] == "fp8" else bwd_units + bwd_units[-1:0:-1]
            assert row["fp8_gather_bytes"] == want, (row["step"], row["fp8_gather_bytes"], want)
            assert row["reference_bytes"] == expected["hp"] + expected["hp"][-1:0:-1], row["reference_bytes"]
            # each shard's amax reduced once per fp8 step (torch's AdamW changed it), by the forward's all-gather
            assert row["amax_reductions"] == (expected["shards_kept"] if row["precision"] == "fp8" else 0), row
        assert expected["shards_kept"] == 7 * OVERRIDES["n_layers"]
        # the linear weights move in one byte per element instead of param_dtype's
        assert expected["linear_weights_hp"] == _DTYPES[param_dtype].itemsize * expected["linear_weights_fp8"]
    fp8_step = data["steps"][0]
    print(f"\nworld {world}, param_dtype {param_dtype}: bytes per rank per all-gather (root, blocks..., backward "
              f"blocks) fp8 {fp8_step['fp8_gather_bytes']} vs {fp8_step['reference_bytes']}")


class AllReduces:
    """Records the number of elements of each torch.distributed.all_reduce call while the test runs (the amax
    all-reduces of the fp8 all-gather go through it)."""

    def __enter__(self) -> Self:
        self.numels: list[int] = []
        self._orig = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.numels.append(tensor.numel())
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._orig

    def take(self) -> list[int]:
        out, self.numels = self.numels, []
        return out


def _amax_batch_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import fp8
    from fp8.fsdp_allgather import is_fp8_all_gather_weight

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        model, ref = _build_pair(init_device_mesh("cpu", (world,)), torch.bfloat16)
        first_linear = next(n for n, m in model.named_modules() if n.startswith("layers.0.")
                            and isinstance(getattr(m, "weight", None), torch.Tensor)
                            and is_fp8_all_gather_weight(m.weight))
        opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in (model, ref)]
        gen = torch.Generator().manual_seed(11)
        # all fp8; one linear of block 0 in bf16 (the policy's per-layer fallback); all bf16; all fp8 again
        schedule = [("fp8", None), ("bf16", first_linear), ("bf16", None), ("fp8", None)]
        rows = []
        with AllReduces() as counter:
            for step, (precision, scope) in enumerate(schedule):
                tokens = torch.randint(0, 256, (world * BATCH, SEQ + 1), generator=gen)[rank * BATCH:(rank + 1) * BATCH]

                def set_precision(m, precision=precision, scope=scope):
                    if scope is not None:  # one linear falls back, the others stay in fp8
                        fp8.set_precision(m, "fp8")
                    fp8.set_precision(m, precision, scope=scope)

                rows.append({"step": step, **_step_both(model, ref, opts, tokens, counter, "all_reduces",
                                                        set_precision)})
        with open(Path(out) / f"amax{rank}.json", "w") as f:
            json.dump(rows, f)


def test_fp8_all_gather_reduces_the_amaxes_of_a_unit_in_one_all_reduce(tmp_path):
    """One MAX all-reduce of the stacked amaxes per FSDP2 unit all-gather (block forward, block backward re-gather),
    of as many elements as the unit has linears computing in fp8, where each weight used to make its own (7 a block:
    28 a step here, 4 now); the loss, gradients and weights stay bit-equal to the high-precision gather."""
    mp.spawn(_amax_batch_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    n_blocks = OVERRIDES["n_layers"]
    linears = 7  # wq wk wv wo w1 w2 w3
    # forward block 0, block 1; backward re-gathers block 1, block 0
    want = [[linears] * 2 * n_blocks, [linears - 1] + [linears] * (2 * n_blocks - 2) + [linears - 1], [],
            [linears] * 2 * n_blocks]
    for rank in range(2):
        rows = json.loads((tmp_path / f"amax{rank}.json").read_text())
        assert [r["fp8_gather_all_reduces"] for r in rows] == want, rows
        assert all(r["reference_all_reduces"] == [] for r in rows), rows
        for r in rows:
            assert r["fp8_gather_loss"] == r["reference_loss"], r
            assert r["grads_unequal"] == [] and r["weights_unequal"] == [], r


def _compiled_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        model, ref = _build_pair(init_device_mesh("cpu", (world,)), torch.float32)
        for m in (model, ref):  # as orchestration.training.loop.compile_blocks: each FSDP2 block compiled
            for name, block in list(m.layers.named_children()):
                m.layers.register_module(name, torch.compile(block))
        tokens = torch.randint(0, 256, (world * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
        tokens = tokens[rank * BATCH:(rank + 1) * BATCH]
        losses, grads = [], []
        for m in (model, ref):
            loss = m(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
            grads.append({n: _local(p.grad) for n, p in m.named_parameters()})
        with open(Path(out) / f"compiled{rank}.json", "w") as f:
            json.dump({"losses": losses, "grads_unequal": [n for n in grads[1]
                                                           if not torch.equal(grads[0][n], grads[1][n])]}, f)


def test_fp8_all_gather_is_bit_equal_under_torch_compile(tmp_path):
    mp.spawn(_compiled_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        data = json.loads((tmp_path / f"compiled{rank}.json").read_text())
        assert data["losses"][0] == data["losses"][1] and data["grads_unequal"] == [], data


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: saved at 2 ranks with the fp8 all-gather, loaded by 1 plain process, saved there, loaded at 4 ranks


def _sharded_model(world: int, fp8_all_gather: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fp8
    from fp8.fsdp_allgather import enable_fp8_all_gather, track_fsdp_params
    from models.registry import build_model

    model = build_model(FLAVOR, device="cpu", overrides=OVERRIDES, seed=world)  # weights the load must replace
    fp8.convert_to_fp8(model, "tensorwise")
    if world > 1:
        if fp8_all_gather:
            enable_fp8_all_gather(model)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        track_fsdp_params(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _train_step(model, opt, rank: int, world: int, seed: int) -> float:
    tokens = torch.randint(0, 256, (4, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    tokens = tokens[rank * 4 // world:(rank + 1) * 4 // world]
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full_state(model, opt) -> dict:
    """Unsharded model and optimizer state as plain tensors (collective under FSDP2; rank 0 gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = dist.is_initialized()
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    if full and dist.get_rank() != 0:
        return {}
    return {"model": {k: v.detach().clone() for k, v in model_sd.items()},
            "optim": {k: {n: t.clone() for n, t in s.items()} for k, s in optim_sd["state"].items()}}


def _checkpoint_worker(rank: int, world: int, port: int, root: str, out: str, mode: str) -> None:
    from orchestration.checkpoint.manager import CheckpointManager

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        model, opt = _sharded_model(world, fp8_all_gather=True)
        mgr = CheckpointManager(Path(root) / mode)
        if mode == "save":
            _train_step(model, opt, rank, world, seed=1)
            mgr.save(1, model, opt, None, {})
        else:
            src = CheckpointManager(Path(root) / "plain", create=False)
            mgr.load(src.latest(collective=True), model, opt, None)
        state = _full_state(model, opt)
        loss = _train_step(model, opt, rank, world, seed=2)  # trains on after a load
        if rank == 0:
            torch.save({"state": state, "loss": loss}, Path(out) / f"{mode}_{world}.pt")


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert type(got["model"][k]) is torch.Tensor and torch.equal(got["model"][k], v), k
    assert got["optim"].keys() == want["optim"].keys()
    for k, s in want["optim"].items():
        for n, t in s.items():
            assert type(got["optim"][k][n]) is torch.Tensor and torch.equal(got["optim"][k][n], t), (k, n)


def test_fp8_all_gather_checkpoints_reshard_two_to_one_to_four(tmp_path):
    from orchestration.checkpoint.manager import CheckpointManager

    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(_checkpoint_worker, args=(2, free_port(), str(root), str(out), "save"), nprocs=2, join=True)
    saved = torch.load(out / "save_2.pt", weights_only=True)["state"]

    # one plain process (no FSDP2, no wrapper): the checkpoint holds ordinary tensors
    model, opt = _sharded_model(1, fp8_all_gather=True)
    CheckpointManager(root / "save", create=False).load(CheckpointManager(root / "save").latest(), model, opt, None)
    _assert_same_state(_full_state(model, opt), saved)
    CheckpointManager(root / "plain", rank=0, world_size=1).save(1, model, opt, None, {})

    mp.spawn(_checkpoint_worker, args=(4, free_port(), str(root), str(out), "load"), nprocs=4, join=True)
    loaded = torch.load(out / "load_4.pt", weights_only=True)
    _assert_same_state(loaded["state"], saved)
    assert torch.isfinite(torch.tensor(loaded["loss"]))


# ---------------------------------------------------------------------------------------------------------------
# GPU: the gathered fp8 weight through torch.compile'd blocks (one rank, NCCL; FSDP2 still runs its all-gather hooks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_all_gather_under_compile_matches_the_high_precision_gather_on_gpu():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp8
    from fp8.fsdp_allgather import enable_fp8_all_gather, track_fsdp_params
    from models.registry import build_model

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,))
        base = build_model(FLAVOR, device="cuda", overrides=OVERRIDES, seed=0)
        fp8.convert_to_fp8(base, "tensorwise")
        ref = copy.deepcopy(base)
        enable_fp8_all_gather(base)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for m in (base, ref):
            for name, block in list(m.layers.named_children()):
                fully_shard(block, mesh=mesh, mp_policy=policy)
                m.layers.register_module(name, torch.compile(block))
            fully_shard(m, mesh=mesh, mp_policy=policy)
        track_fsdp_params(base)
        tokens = torch.randint(0, 256, (4, SEQ + 1), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
        losses, grads = [], []
        for m in (base, ref):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
            grads.append({n: _local(p.grad).float() for n, p in m.named_parameters()})
        assert losses[0] == pytest.approx(losses[1], rel=1e-3), losses
        for n, g in grads[1].items():
            torch.testing.assert_close(grads[0][n], g, rtol=2e-2, atol=1e-4, msg=n)
    finally:
        dist.destroy_process_group()
