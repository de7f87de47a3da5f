"""Tests of orchestration/checkpoint/manager.py: DCP round trips (FSDP2 on gloo, plain), RNG, corruption, retention.

Legend: sd = state dict; full sd = unsharded tensors gathered on rank 0.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from orchestration.checkpoint.directory import MANIFEST, CheckpointError, CheckpointInfo, ray_checkpoint_dir
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.checkpoint.rng import derive_rng_seed
from orchestration.training.checkpointing import is_out_of_space
from tests.conftest import size_limited_tmpfs
from tests.spawned import free_port, rank_process_group

# ---------------------------------------------------------------------------------------------------------------
# Tiny model and training helpers (shared by the spawned workers and the local tests)


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 5 output rows over 2 ranks: FSDP2 shards unevenly (3 + 2), the harder resharding case
        self.layers = nn.ModuleList([nn.Linear(6, 5), nn.Linear(5, 3)])
        self.register_buffer("scale", torch.tensor([1.5, 2.0, 0.5]))

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x_BD))) * self.scale


def halving(step: int) -> float:
    return 0.5**step


def build(seed: int) -> tuple[TinyNet, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, halving)
    return model, opt, sched


def build_fsdp(seed: int, mesh) -> tuple[TinyNet, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """build(seed) with each layer and the root sharded by FSDP2 over `mesh`, optimizer and scheduler over the
    sharded parameters."""
    from torch.distributed.fsdp import fully_shard

    model, _, _ = build(seed)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, halving)


def train_steps(model, opt, sched, n: int, *, rank: int = 0, world: int = 1, offset: int = 0) -> None:
    gen = torch.Generator().manual_seed(1234)
    for i in range(n):
        x_BD = torch.randn(4 * world, 6, generator=gen)[4 * rank: 4 * (rank + 1)] + 0.1 * (i + offset)
        loss = (model(x_BD) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def full_state(model, opt) -> dict:
    """Unsharded model + optimizer state keyed by FQN (collective for FSDP2; rank 0 gets the tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = dist.is_initialized()
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full,
                                                                              cpu_offload=full))
    if full and dist.get_rank() != 0:
        return {}  # cpu_offload leaves the full tensors on rank 0 only
    return {"model": {k: v.detach().clone() for k, v in model_sd.items()},
            "optim_state": {k: {n: t.clone() for n, t in s.items()} for k, s in optim_sd["state"].items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optim_sd["param_groups"]]}


def assert_states_bit_identical(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k in want["model"]:
        assert got["model"][k].dtype == want["model"][k].dtype
        assert torch.equal(got["model"][k], want["model"][k]), k
    assert got["optim_state"].keys() == want["optim_state"].keys()
    for k, s in want["optim_state"].items():
        assert s.keys() == got["optim_state"][k].keys()
        for n, t in s.items():
            assert torch.equal(got["optim_state"][k][n], t), (k, n)
    assert got["param_groups"] == want["param_groups"]


def draw_rngs() -> tuple:
    return torch.rand(3), random.random(), float(np.random.rand())


def same_draws(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]




# ---------------------------------------------------------------------------------------------------------------
# Two ranks, gloo, FSDP2


def _worker(rank: int, world: int, port: int, root_a: str, root_b: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        out_dir = Path(out)
        # a different init than the checkpoint: loading must overwrite it
        model, opt, sched = build_fsdp(99, init_device_mesh("cpu", (world,)))

        # 1 -> 2 ranks: a checkpoint written by a single plain process loads into the FSDP2 shards
        mgr_a = CheckpointManager(root_a, create=False)
        info_a = mgr_a.latest(collective=True)
        extra_a = mgr_a.load(info_a, model, opt, sched)
        full_a = full_state(model, opt)
        if rank == 0:
            torch.save({"state": full_a, "extra": extra_a, "sched": sched.state_dict(), "rng": mgr_a.last_load_rng},
                       out_dir / "a_loaded.pt")

        # train on, save from 2 ranks
        train_steps(model, opt, sched, 2, rank=rank, world=world, offset=1)
        events: list = []
        mgr_b = CheckpointManager(root_b, event_sink=lambda n, p: events.append((n, p)))
        torch.manual_seed(100 + rank)
        random.seed(200 + rank)
        np.random.seed(300 + rank)
        path = mgr_b.save(3, model, opt, sched, {"data": {"next_index": 24}, "rank_written": "rank 0"})
        draws_after_save = draw_rngs()
        ref_b = full_state(model, opt)
        sched_b = sched.state_dict()

        # a newer checkpoint whose damage only rank 1 sees: in a collective `latest` rank 1 hashes the odd-indexed
        # files, so a flipped byte there must make both ranks fall back to step 3 together
        path4 = mgr_b.save(4, model, opt, sched, {"data": {"next_index": 32}})
        if rank == 0:
            odd_file = sorted(json.loads((path4 / MANIFEST).read_text())["files"])[1]
            _flip_byte(path4 / odd_file)
        dist.barrier()

        # diverge (params, optimizer, scheduler, RNG), then come back from the checkpoint at the same world size
        train_steps(model, opt, sched, 1, rank=rank, world=world, offset=7)
        torch.manual_seed(5)
        random.seed(5)
        np.random.seed(5)
        info_b = mgr_b.latest(collective=True)
        extra_b = mgr_b.load(info_b, model, opt, sched)
        draws_after_load = draw_rngs()
        reloaded_b = full_state(model, opt)
        torch.save({"after_save": draws_after_save, "after_load": draws_after_load, "rng": mgr_b.last_load_rng,
                    "path": str(path), "events": events}, out_dir / f"rng_{rank}.pt")
        if rank == 0:
            torch.save({"ref": ref_b, "reloaded": reloaded_b, "extra": extra_b, "sched_ref": sched_b,
                        "sched_reloaded": sched.state_dict(), "info_step": info_b.step,
                        "info_world": info_b.world_size}, out_dir / "b.pt")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    root_a, root_b, out = base / "a", base / "b", base / "out"
    out.mkdir()
    # checkpoint A: one plain process, world size 1
    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 1)
    CheckpointManager(root_a, rank=0, world_size=1).save(1, model, opt, sched, {"data": {"next_index": 4}})
    ref_a = full_state(model, opt)
    mp.spawn(_worker, args=(2, free_port(), str(root_a), str(root_b), str(out)), nprocs=2, join=True)
    return {"ref_a": ref_a, "sched_a": sched.state_dict(), "root_b": root_b, "out": out}


def test_fsdp2_one_rank_checkpoint_reshards_into_two(fsdp_run):
    got = torch.load(fsdp_run["out"] / "a_loaded.pt", weights_only=True)
    assert_states_bit_identical(got["state"], fsdp_run["ref_a"])
    assert got["extra"] == {"data": {"next_index": 4}}
    assert got["sched"] == fsdp_run["sched_a"]
    assert got["rng"] == "derived"  # world size 1 -> 2


def test_fsdp2_two_rank_save_reload_same_world_size(fsdp_run):
    b = torch.load(fsdp_run["out"] / "b.pt", weights_only=True)
    assert (b["info_step"], b["info_world"]) == (3, 2)
    assert_states_bit_identical(b["reloaded"], b["ref"])
    assert b["sched_reloaded"] == b["sched_ref"] and b["sched_ref"]["last_epoch"] == 3
    assert b["extra"] == {"data": {"next_index": 24}, "rank_written": "rank 0"}
    # the model really moved between the two checkpoints, so the equality above is not vacuous
    a = torch.load(fsdp_run["out"] / "a_loaded.pt", weights_only=True)
    assert not torch.equal(a["state"]["model"]["layers.0.weight"], b["ref"]["model"]["layers.0.weight"])


def test_fsdp2_rng_restored_per_rank(fsdp_run):
    r0 = torch.load(fsdp_run["out"] / "rng_0.pt", weights_only=True)
    r1 = torch.load(fsdp_run["out"] / "rng_1.pt", weights_only=True)
    for r in (r0, r1):
        assert r["rng"] == "restored"
        assert same_draws(r["after_save"], r["after_load"])
    assert not same_draws(r0["after_save"], r1["after_save"])  # each rank got its own state back
    assert [n for n, _ in r0["events"]] == ["checkpoint_saved", "checkpoint_saved", "checkpoint_corrupt",
                                            "checkpoint_loaded"]
    assert r1["events"] == []  # collective latest reports from rank 0 only
    corrupt = r0["events"][2][1]
    assert corrupt["step"] == 4 and corrupt["reason"].startswith("rank 1: sha256 mismatch")


def test_fsdp2_two_rank_checkpoint_loads_into_one_plain_rank(fsdp_run):
    b = torch.load(fsdp_run["out"] / "b.pt", weights_only=True)
    root_b = fsdp_run["root_b"]
    manifest = json.loads((root_b / "step_000003" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["good"] is False
    assert {"rng/rank_00000.pt", "rng/rank_00001.pt"} <= manifest["files"].keys()
    # both ranks wrote shards (DCP names them __<rank>_<file>.distcp; each rank writes one file per writer thread)
    writers = {int(m.group(1)) for f in manifest["files"] if (m := re.search(r"__(\d+)_\d+\.distcp$", f))}
    assert writers == {0, 1}

    model, opt, sched = build(seed=7)
    mgr = CheckpointManager(root_b, rank=0, world_size=1, seed=11)
    info = mgr.latest()
    extra = mgr.load(info, model, opt, sched)
    assert_states_bit_identical(full_state(model, opt), b["ref"])
    assert sched.state_dict() == b["sched_ref"]
    assert extra["data"]["next_index"] == 24
    # world size 2 -> 1: RNG comes from the documented derivation, not from rank 0's saved state
    assert mgr.last_load_rng == "derived"
    got = draw_rngs()
    torch.manual_seed(derive_rng_seed(11, 3, 0))
    random.seed(derive_rng_seed(11, 3, 0))
    np.random.seed(derive_rng_seed(11, 3, 0) % 2**32)
    assert same_draws(got, draw_rngs())


# ---------------------------------------------------------------------------------------------------------------
# Single process, no process group


def _saved(root: Path, steps, **kw) -> tuple[CheckpointManager, list, tuple]:
    events: list = []
    mgr = CheckpointManager(root, rank=0, world_size=1, event_sink=lambda n, p: events.append((n, p)), **kw)
    model, opt, sched = build(seed=0)
    for step in steps:
        train_steps(model, opt, sched, 1, offset=step)
        mgr.save(step, model, opt, sched, {"data": {"next_index": 4 * step}})
    return mgr, events, (model, opt, sched)


def test_plain_round_trip_with_scheduler_and_extra_state(tmp_path):
    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 3)
    extra = {"data": {"next_index": 96, "consumed": [[0, 96]]}, "precision": {"mode": "fp8", "scope": None},
             "policy": {"bad_steps": 0, "ema": 1.25}, "plan": {"world_size": 1, "grad_accum": 4}}
    mgr = CheckpointManager(tmp_path / "ck", rank=0, world_size=1)
    path = mgr.save(3, model, opt, sched, extra)
    assert path == tmp_path / "ck" / "step_000003" and not list((tmp_path / "ck").glob(".tmp-*"))

    model2, opt2, sched2 = build(seed=1)
    assert not torch.equal(model2.layers[0].weight, model.layers[0].weight)
    got_extra = mgr.load(mgr.latest(), model2, opt2, sched2)
    assert got_extra == extra
    assert_states_bit_identical(full_state(model2, opt2), full_state(model, opt))
    assert torch.equal(model2.scale, model.scale)
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == [0.05 * 0.5**3]
    # one more identical step on both gives identical parameters: nothing of the training state was lost
    train_steps(model, opt, sched, 1, offset=3)
    train_steps(model2, opt2, sched2, 1, offset=3)
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def _two_groups(model: TinyNet) -> torch.optim.Optimizer:
    """The optimizer of build() with the second layer's parameters in a group of their own, as expert parallelism
    groups the experts' parameters (one group per device mesh, orchestration/training/optimizer.py)."""
    return torch.optim.AdamW([{"params": list(model.layers[0].parameters())},
                              {"params": list(model.layers[1].parameters())}], lr=0.05, weight_decay=0.1)


@pytest.mark.parametrize("saved_groups", [1, 2])
def test_optimizer_state_loads_into_another_grouping_of_the_parameters(tmp_path, saved_groups):
    """A resize that adds or drops expert parallelism changes the optimizer's param groups (1 <-> 2): the load keeps
    every state tensor and gives every group its settings (with torch's set_state_dict alone, 1 -> 2 left the
    second group without betas, and its step raised KeyError)."""
    model, opt, sched = build(seed=0)
    if saved_groups == 2:
        opt = _two_groups(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, halving)
    train_steps(model, opt, sched, 3)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    mgr.save(3, model, opt)

    model2, opt2, _ = build(seed=1)
    if saved_groups == 1:
        opt2 = _two_groups(model2)
    mgr.load(mgr.latest(), model2, opt2)
    assert len(opt2.param_groups) == 3 - saved_groups
    saved, loaded = full_state(model, opt), full_state(model2, opt2)
    assert_states_bit_identical({**loaded, "param_groups": loaded["param_groups"][:1]},
                                {**saved, "param_groups": saved["param_groups"][:1]})
    assert all(g == saved["param_groups"][0] for g in loaded["param_groups"]), loaded["param_groups"]
    # the same step on both: the same parameters
    for m, o in ((model, opt), (model2, opt2)):
        (m(torch.ones(2, 6)) ** 2).mean().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_model_only_and_missing_scheduler_errors(tmp_path):
    model, _, _ = build(seed=0)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    mgr.save(0, model)  # model only
    model2, opt2, sched2 = build(seed=3)
    with pytest.raises(CheckpointError, match="without a scheduler"):
        mgr.load(mgr.latest(), model2, opt2, sched2)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        mgr.load(mgr.latest(), model2, opt2)
    assert mgr.load(mgr.latest(), model2) == {}
    assert torch.equal(model2.layers[1].weight, model.layers[1].weight)


def test_only_tensors_go_through_dcp_and_own_files_load_weights_only(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mgr, _, _ = _saved(tmp_path, [1])
    path = mgr.latest().path
    metadata = FileSystemReader(str(path / "dcp")).read_metadata()
    kinds = {type(m).__name__ for m in metadata.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata.__name__}  # no pickled bytes items that DCP would load unsafely
    assert "model.layers.0.weight" in metadata.state_dict_metadata
    for rel in ("state_meta.pt", "scheduler.pt", "rng/rank_00000.pt"):
        torch.load(path / rel, weights_only=True)


def test_rng_restore_same_world_size(tmp_path):
    model, opt, sched = build(seed=0)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    torch.manual_seed(42)
    random.seed(43)
    np.random.seed(44)
    mgr.save(5, model, opt, sched)
    want = draw_rngs()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    mgr.load(mgr.latest(), model, opt, sched)
    assert mgr.last_load_rng == "restored"
    assert same_draws(draw_rngs(), want)


def test_derive_rng_seed_is_pure_and_distinct():
    assert derive_rng_seed(0, 10, 1) == derive_rng_seed(0, 10, 1)
    seeds = {derive_rng_seed(s, st, r) for s in (0, 1) for st in (10, 11) for r in (0, 1, 2)}
    assert len(seeds) == 12 and all(0 <= x < 2**63 for x in seeds)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped_byte_in_shard": (lambda d: _flip_byte(next((d / "dcp").glob("*.distcp"))), "sha256 mismatch"),
    "flipped_byte_in_metadata": (lambda d: _flip_byte(d / "dcp" / ".metadata"), "sha256 mismatch in dcp/.metadata"),
    "missing_rng_file": (lambda d: (d / "rng" / "rank_00000.pt").unlink(), "file missing: rng/rank_00000.pt"),
    "truncated_extra_state": (lambda d: (d / "extra_state.json").write_text("{"), "size mismatch in extra_state"),
    "missing_manifest": (lambda d: (d / MANIFEST).unlink(), "manifest.json missing"),
    "garbage_manifest": (lambda d: (d / MANIFEST).write_text("{not json"), "unreadable manifest.json"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_skipped_with_event(tmp_path, kind):
    corrupt, reason = CORRUPTIONS[kind]
    mgr, events, _ = _saved(tmp_path, [1, 2])
    bad = tmp_path / "step_000002"
    corrupt(bad)
    events.clear()
    info = mgr.latest()
    assert info is not None and info.step == 1 and info.path == tmp_path / "step_000001"
    assert [n for n, _ in events] == ["checkpoint_corrupt"]
    payload = events[0][1]
    assert payload["step"] == 2 and payload["path"] == str(bad) and reason in payload["reason"]
    assert bad.is_dir()  # finding and loading never delete
    model, opt, sched = build(seed=5)
    assert mgr.load(info, model, opt, sched) == {"data": {"next_index": 4}}
    assert bad.is_dir()
    with pytest.raises(CheckpointError, match=f"checkpoint {bad}"):
        mgr.verify(bad)


@pytest.fixture
def escaped_thread_errors(monkeypatch) -> list:
    """The exceptions that reach the process's thread exception hook (Python's default prints them; pytest's own
    plugin keeps them from the console, so the test stands in a recorder for it)."""
    escaped: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    return escaped


def _writer_threads(monkeypatch, n: int) -> None:
    """Saves write from n threads (io_threads() is the machine's: min(8, CPUs per local rank), 2 on a 2-core CI
    machine, 8 on a 16-core GPU node)."""
    from orchestration.checkpoint import writer

    monkeypatch.setattr(writer, "io_threads", lambda: n)


def _failing_dcp_writes(*, caller_fails: bool) -> None:
    """Make DCP's writes fail (injected: a disk error cannot be had on demand here). Its own writer threads raise
    EIO; the caller's thread writes normally, once a side thread has taken a file (however the threads are
    scheduled). caller_fails: the caller's thread raises ENOSPC instead, and the side threads fail 0.2 s after it,
    when dcp.save is already raising without having joined them."""
    import time

    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    write_item, side_started, caller_failed = dcp_filesystem._write_item, threading.Event(), threading.Event()

    def write(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            assert side_started.wait(10), "no DCP writer thread took a file"
            if caller_fails:
                caller_failed.set()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write_item(*args, **kwargs)
        side_started.set()
        if caller_fails:
            caller_failed.wait(10)
            time.sleep(0.2)
        raise OSError(errno.EIO, "Input/output error (injected)")

    dcp_filesystem._write_item = write


def _dcp_writer_threads_alive() -> list[str]:
    from orchestration.checkpoint.writer import DCP_WRITER_FUNCTION

    return [t.name for t in threading.enumerate() if t.name.endswith(f"({DCP_WRITER_FUNCTION})")]


@pytest.mark.parametrize("caller_fails", [False, True], ids=["side_threads_fail", "caller_fails_first"])
def test_a_failed_dcp_writer_thread_fails_the_save_and_the_last_checkpoint_stays_latest(tmp_path, monkeypatch,
                                                                                         escaped_thread_errors,
                                                                                         caller_fails):
    """DCP's FileSystemWriter writes from threads of its own besides the caller's; an exception in one ends only that
    thread: Python printed its traceback and dcp.save returned normally without that thread's files, so the save
    published a checkpoint that did not load. Such a failure now fails the save with its cause; when the caller's
    thread fails first (DCP's own CheckpointException), its threads are joined before the save returns. Either way
    no exception escapes to the process's hook and the previous checkpoint stays the latest."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    mgr, _events, (model, opt, sched) = _saved(tmp_path, [1])
    _writer_threads(monkeypatch, 4)
    monkeypatch.setattr(dcp_filesystem, "_write_item", dcp_filesystem._write_item)  # put back at the end
    _failing_dcp_writes(caller_fails=caller_fails)
    if caller_fails:
        with pytest.raises(CheckpointException) as failure:
            mgr.save(2, model, opt, sched, {"data": {"next_index": 8}})
        assert is_out_of_space(failure.value), failure.value
    else:
        with pytest.raises(CheckpointError, match=r"writing .*step_000002 failed: rank 0: OSError: \[Errno 5\] Inp"):
            mgr.save(2, model, opt, sched, {"data": {"next_index": 8}})
    assert _dcp_writer_threads_alive() == [] and escaped_thread_errors == []
    assert [step for step, _ in mgr.finalized()] == [1] and mgr.latest().step == 1
    model2, opt2, sched2 = build(seed=5)
    assert mgr.load(mgr.latest(), model2, opt2, sched2) == {"data": {"next_index": 4}}


def _side_thread_failure_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    from orchestration.checkpoint import writer

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        model, opt, sched = build(seed=0)
        mgr = CheckpointManager(root, rank=rank, world_size=world)
        mgr.save(1, model, opt, sched, {})
        writer.io_threads = lambda: 4  # type: ignore[assignment]  # as on a node with CPUs to spare
        if rank == 1:
            _failing_dcp_writes(caller_fails=False)
        try:
            mgr.save(2, model, opt, sched, {})
            outcome = "saved"
        except CheckpointError as e:
            outcome = str(e)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"outcome": outcome,
                                                             "finalized": [s for s, _ in mgr.finalized()]}))


def test_a_writer_thread_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    """Only rank 1's writer threads fail: both ranks raise the same error, naming rank 1, and step 1 stays."""
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_side_thread_failure_worker, args=(2, free_port(), str(tmp_path / "ck"), str(out)), nprocs=2, join=True)
    outcomes = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for got in outcomes:
        assert re.fullmatch(r"writing .*step_000002 failed: rank 1: OSError: \[Errno 5\] Input/output error \(injected\)",
                            got["outcome"]), got
        assert got["finalized"] == [1]


def test_a_full_disk_under_several_writer_threads_fails_the_save_without_a_traceback(tmp_path, monkeypatch,
                                                                                    escaped_thread_errors):
    """A real full disk (a 1 MiB tmpfs; root mounts it, as CI runs) and eight writer threads, as on a 16-core node:
    the save fails naming the full disk, and no writer thread's traceback reaches the console (a worker's console
    showed them on an H100 node)."""
    with size_limited_tmpfs(tmp_path / "disk", "1m") as mount:
        _writer_threads(monkeypatch, 8)
        mgr = CheckpointManager(mount / "ck", rank=0, world_size=1)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(24)])  # 24 x 66 KB of weights: 1.5 MiB
        # DCP's own CheckpointException when the caller's thread failed too, CheckpointError when only other threads
        # did: the training loop takes both, and tells a full disk by is_out_of_space.
        with pytest.raises((CheckpointError, CheckpointException)) as failure:
            mgr.save(1, model, None, None, {})
        assert is_out_of_space(failure.value), failure.value
        assert _dcp_writer_threads_alive() == [] and escaped_thread_errors == []
        assert mgr.finalized() == []


def test_partial_dir_with_only_some_files_and_no_valid_checkpoint(tmp_path):
    events: list = []
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, event_sink=lambda n, p: events.append(n))
    (tmp_path / "step_000004" / "dcp").mkdir(parents=True)  # e.g. a copy that stopped half way
    assert mgr.latest() is None and events == ["checkpoint_corrupt"]
    assert mgr.latest(good_only=True) is None


def test_tmp_dirs_are_ignored_and_cleaned_by_rank0(tmp_path):
    _saved(tmp_path, [1])
    leftover = tmp_path / ".tmp-step_000002"
    (leftover / "dcp").mkdir(parents=True)
    (leftover / MANIFEST).write_text("{}")
    other = CheckpointManager(tmp_path, rank=1, world_size=2)  # not rank 0: must not clean
    assert leftover.is_dir() and other.latest().step == 1
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    assert not leftover.exists() and mgr.latest().step == 1


def test_good_marks_and_good_only(tmp_path):
    mgr, events, _ = _saved(tmp_path, [1, 2, 3], keep_last=5)
    assert mgr.latest(good_only=True) is None
    mgr.mark_good(2)
    manifest = json.loads((tmp_path / "step_000002" / MANIFEST).read_text())
    assert manifest["good"] is True and "good_time" in manifest
    assert mgr.latest().step == 3 and mgr.latest(good_only=True).step == 2
    assert mgr.verify(tmp_path / "step_000002").good  # the good mark does not break the checksums
    assert ("checkpoint_good", {"step": 2, "path": str(tmp_path / "step_000002")}) in events
    CheckpointManager(tmp_path, rank=1, world_size=2).mark_good(3)  # non-zero ranks do not write
    assert mgr.latest(good_only=True).step == 2
    with pytest.raises(CheckpointError, match="cannot mark step 9 good"):
        mgr.mark_good(9)


def test_retention_keeps_last_n_and_newest_good(tmp_path):
    mgr, events, state = _saved(tmp_path, [1, 2], keep_last=2, keep_good=1)
    mgr.mark_good(2)
    model, opt, sched = state
    for step in (3, 4, 5):
        mgr.save(step, model, opt, sched)
    # step 2 is older than the last two but is the newest good one
    assert [s for s, _ in mgr.finalized()] == [5, 4, 2]
    deleted = [p["step"] for n, p in events if n == "checkpoint_deleted"]
    assert deleted == [1, 3]
    mgr.mark_good(4)  # keep_good=1: the older good one (2) may go now
    assert [s for s, _ in mgr.finalized()] == [5, 4]
    assert not list(tmp_path.glob(".tmp-*"))


def test_retention_keep_good_two(tmp_path):
    mgr, _, (model, opt, sched) = _saved(tmp_path, [], keep_last=1, keep_good=2)
    for step in (1, 2, 3):
        mgr.save(step, model, opt, sched)
        mgr.mark_good(step)
    mgr.save(4, model, opt, sched)
    assert mgr.retention_plan() == ([2, 3, 4], [])
    assert [s for s, _ in mgr.finalized()] == [4, 3, 2]


def test_retention_keeps_checkpoints_awaiting_their_good_mark(tmp_path):
    """A checkpoint waiting for good_after_steps clean steps survives keep_last (saves more frequent than the wait
    used to delete it, and its mark_good then failed on rank 0); once marked or given up on, retention applies."""
    mgr, events, (model, opt, sched) = _saved(tmp_path, [], keep_last=2, keep_good=1)
    mgr.save(1, model, opt, sched)
    mgr.mark_good(1)
    for step in (2, 3, 4):
        mgr.save(step, model, opt, sched)
        mgr.awaiting_good.add(step)
    assert [s for s, _ in mgr.finalized()] == [4, 3, 2, 1]  # 2 outlived keep_last=2: still awaiting
    mgr.mark_good(2)  # would raise "does not exist" had retention deleted it
    assert 2 not in mgr.awaiting_good
    assert [s for s, _ in mgr.finalized()] == [4, 3, 2]  # 1: no longer the newest good one
    mgr.awaiting_good.discard(3)  # trouble after 3: the worker gives up on it
    mgr.save(5, model, opt, sched)
    assert [s for s, _ in mgr.finalized()] == [5, 4, 2]  # 4 still awaiting; 3 went; 2 the newest good
    assert [p["step"] for n, p in events if n == "checkpoint_deleted"] == [1, 3]


def test_resave_same_step_replaces_and_discard_newer(tmp_path):
    mgr, events, (model, opt, sched) = _saved(tmp_path, [1, 2, 3], keep_last=5)
    mgr.save(3, model, opt, sched, {"again": True})
    info = mgr.latest()
    assert info.step == 3 and json.loads((info.path / "extra_state.json").read_text()) == {"again": True}
    assert mgr.discard_newer_than(1) == [tmp_path / "step_000003", tmp_path / "step_000002"]
    assert mgr.latest().step == 1 and not list(tmp_path.glob(".tmp-*"))
    assert [(p["step"], p["reason"]) for n, p in events if n == "checkpoint_deleted"] == [
        (3, "rollback to step 1"), (2, "rollback to step 1")]


def _inodes(path: Path) -> dict[str, int]:
    return {f.relative_to(path).as_posix(): f.stat().st_ino for f in path.rglob("*") if f.is_file()}


def test_resave_extra_state_links_the_files_and_publishes_the_step_good(tmp_path):
    mgr, events, (model, opt, sched) = _saved(tmp_path, [1, 2])
    ref = full_state(model, opt)
    info = mgr.latest()
    before = _inodes(info.path)
    events.clear()
    path = mgr.resave_extra_state(info, {"data": {"next_index": 99}})
    assert path == tmp_path / "step_000002" and not list(tmp_path.glob(".tmp-*"))
    after = _inodes(path)
    kept = sorted(set(before) - {"extra_state.json", "manifest.json"})
    assert kept and all(after[rel] == before[rel] for rel in kept)  # the same files, not copies
    assert after["extra_state.json"] != before["extra_state.json"]
    assert mgr.last_save_timing["linked_files"] == len(kept)
    assert [(n, p["step"]) for n, p in events] == [("checkpoint_saved", 2), ("checkpoint_good", 2)]
    resaved = mgr.latest(good_only=True)  # verified with checksums, the new extra state's digest included
    assert (resaved.step, resaved.good, resaved.world_size) == (2, True, 1)
    fresh_model, fresh_opt, fresh_sched = build(seed=5)
    assert mgr.load(resaved, fresh_model, fresh_opt, fresh_sched) == {"data": {"next_index": 99}}
    assert_states_bit_identical(full_state(fresh_model, fresh_opt), ref)
    assert fresh_sched.state_dict() == sched.state_dict()


def test_resave_extra_state_changes_nothing_where_the_filesystem_has_no_hard_links(tmp_path, monkeypatch):
    """Rank 0 copying the files alone would be slower than a save all ranks write: None, and the caller saves."""
    import errno

    from orchestration.checkpoint import writer

    def no_links(src, dst):  # what a FUSE filesystem without link() answers
        raise OSError(errno.ENOSYS, "Function not implemented", str(dst))

    monkeypatch.setattr(writer.os, "link", no_links)
    mgr, events, _ = _saved(tmp_path, [3])
    before = _inodes(tmp_path / "step_000003")
    events.clear()
    assert mgr.resave_extra_state(mgr.latest(), {"again": True}) is None
    assert "Function not implemented" in mgr.last_save_timing["no_hard_links"]
    assert _inodes(tmp_path / "step_000003") == before and not list(tmp_path.glob(".tmp-*")) and events == []
    info = mgr.latest()
    assert not info.good and json.loads((info.path / "extra_state.json").read_text()) == {"data": {"next_index": 12}}


def test_a_failed_resave_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch):
    import errno

    from orchestration.checkpoint import writer

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    mgr, _, _ = _saved(tmp_path, [4])
    monkeypatch.setattr(writer, "file_digests", failing)
    with pytest.raises(CheckpointError, match=r"saving step 4 again .*rank 0: OSError: \[Errno 5\] Input/output error"):
        mgr.resave_extra_state(mgr.latest(), {"lost": True})
    assert not list(tmp_path.glob(".tmp-*"))
    info = mgr.latest()
    assert (info.step, info.good) == (4, False)
    assert json.loads((info.path / "extra_state.json").read_text()) == {"data": {"next_index": 16}}
    with pytest.raises(TypeError, match="extra_state must be a dict"):
        mgr.resave_extra_state(info, ["not", "a", "dict"])


def test_a_failed_rename_while_replacing_a_step_puts_the_old_one_back(tmp_path, monkeypatch):
    from orchestration.checkpoint import writer

    mgr, _, _ = _saved(tmp_path, [5])
    rename = writer.os.rename

    def refuse_the_new_one(src, dst):
        if Path(src).name == ".tmp-step_000005":
            raise OSError(13, "Permission denied", str(dst))
        return rename(src, dst)

    monkeypatch.setattr(writer.os, "rename", refuse_the_new_one)
    with pytest.raises(CheckpointError, match="Permission denied"):
        mgr.resave_extra_state(mgr.latest(), {"lost": True})
    info = mgr.latest()
    assert info.step == 5 and json.loads((info.path / "extra_state.json").read_text()) == {"data": {"next_index": 20}}


@pytest.mark.parametrize("new_one_complete", [True, False])
def test_a_crash_between_the_renames_of_a_replaced_step_is_recovered_at_start(tmp_path, new_one_complete):
    """Killed after step_N moved aside and before the new step_N moved in: the next start puts the new one in place
    when its manifest is written (complete), else the old one; nothing is left under .tmp-."""
    import shutil

    _saved(tmp_path, [6, 7], keep_last=5)
    new = tmp_path / ".tmp-step_000007"
    shutil.copytree(tmp_path / "step_000007", new)
    (new / "extra_state.json").write_text("{}")  # which one comes back, told apart (its digest no longer matches)
    if not new_one_complete:
        (new / "manifest.json").unlink()
    (tmp_path / "step_000007").rename(tmp_path / ".tmp-replaced-step_000007-4242")
    restarted = CheckpointManager(tmp_path, rank=0, world_size=1)
    assert not list(tmp_path.glob(".tmp-*")) and (tmp_path / "step_000007").is_dir()
    extra = (tmp_path / "step_000007" / "extra_state.json").read_text()
    assert (extra == "{}") is new_one_complete
    assert [s for s, _ in restarted.finalized()] == [7, 6]


def test_ray_checkpoint_dir(tmp_path):
    mgr, _, _ = _saved(tmp_path, [1])
    info = mgr.latest()
    assert ray_checkpoint_dir(info) == str(info.path.resolve()) == ray_checkpoint_dir(str(info.path))
    (tmp_path / ".tmp-step_000002").mkdir()
    with pytest.raises(ValueError, match="unfinished temporary"):
        ray_checkpoint_dir(tmp_path / ".tmp-step_000002")
    with pytest.raises(ValueError, match="no manifest.json"):
        ray_checkpoint_dir(tmp_path)


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist; create it or pass create=True"):
        CheckpointManager(tmp_path / "nope", create=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        CheckpointManager(tmp_path / "file")
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_good"):
        CheckpointManager(tmp_path, keep_good=0)
    with pytest.raises(ValueError, match="checksum"):
        CheckpointManager(tmp_path, checksum="crc99")
    mgr = CheckpointManager(tmp_path / "ck", rank=0, world_size=1)
    model, opt, sched = build(seed=0)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        mgr.save(1, model, opt, sched, {"loss": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="step must be an int"):
        mgr.save(-1, model, opt, sched)
    with pytest.raises(ValueError, match="needs an initialized process group"):
        CheckpointManager(tmp_path / "ck", rank=0, world_size=2).save(1, model, opt, sched)
    assert list((tmp_path / "ck").iterdir()) == []  # nothing half-written by the refused saves
    with pytest.raises(CheckpointError, match="manifest.json missing"):
        mgr.load(tmp_path, model, opt, sched)
    (tmp_path / "ck").rmdir()
    with pytest.raises(CheckpointError, match="root .* does not exist"):
        mgr.latest()


def test_blake2b_checksum_and_info_fields(tmp_path):
    mgr, _, _ = _saved(tmp_path, [7], checksum="blake2b")
    info = mgr.latest()
    assert isinstance(info, CheckpointInfo)
    assert (info.step, info.world_size, info.good) == (7, 1, False) and info.manifest["checksum"] == "blake2b"
    assert all(len(f["digest"]) == 128 for f in info.manifest["files"].values())


def test_loading_into_a_model_of_another_shape_names_the_tensor(tmp_path):
    """DCP's own error is a BaseException with every rank's traceback: it becomes a CheckpointError naming the
    mismatched tensor and what to change, and the checkpoint is untouched."""
    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 1)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    path = mgr.save(1, model, opt, sched)
    before = sorted((p.relative_to(path), p.stat().st_size) for p in path.rglob("*") if p.is_file())
    wider = TinyNet()
    wider.layers[0] = nn.Linear(wider.layers[0].in_features, wider.layers[0].out_features + 16)
    wider.layers[1] = nn.Linear(wider.layers[1].in_features + 16, wider.layers[1].out_features)
    wider_opt = torch.optim.AdamW(wider.parameters())
    with pytest.raises(CheckpointError, match=r"does not fit.*Size mismatch.*layers\.0\.weight.*model.overrides"):
        mgr.load(mgr.latest(), wider, wider_opt, torch.optim.lr_scheduler.LambdaLR(wider_opt, halving))
    assert sorted((p.relative_to(path), p.stat().st_size) for p in path.rglob("*") if p.is_file()) == before


def test_an_unreadable_checkpoint_file_is_a_bad_checkpoint_not_a_crash(tmp_path, monkeypatch):
    """An OSError while hashing (I/O error, stale NFS handle) skips that checkpoint like corruption does."""
    import orchestration.checkpoint.directory as ckpt_module

    mgr, events, _ = _saved(tmp_path, [1, 2])
    real_digests = ckpt_module.file_digests

    def failing_digests(paths, algorithm, chunk_bytes, threads=1):
        if any("step_000002" in str(path) for path in paths):
            raise OSError(5, "Input/output error")
        return real_digests(paths, algorithm, chunk_bytes, threads)

    monkeypatch.setattr(ckpt_module, "file_digests", failing_digests)
    assert mgr.latest().step == 1
    corrupt = [p for n, p in events if n == "checkpoint_corrupt"]
    assert [p["step"] for p in corrupt] == [2] and "Input/output error" in corrupt[0]["reason"]


def test_chunked_digest_is_the_hash_of_the_chunk_hashes_in_any_thread_count(tmp_path):
    import hashlib

    import orchestration.checkpoint.directory as ckpt_module

    data = bytes(range(256)) * 1000 + b"tail"  # 256004 bytes: 3 full chunks of 100000 and a partial one
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    chunks = [data[i:i + 100000] for i in range(0, len(data), 100000)]
    expected = hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in chunks)).hexdigest()
    empty = hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest()
    paths = [tmp_path / "a", tmp_path / "empty"]
    for threads in (1, 4):
        assert ckpt_module.file_digests(paths, "sha256", 100000, threads) == [expected, empty]
    # a file shorter than asked for is an I/O error, not a digest of fewer bytes
    with pytest.raises(OSError, match="ended"):
        ckpt_module._chunk_digest(tmp_path / "a", len(data) - 10, 20, "sha256")


def test_saves_record_chunked_digests_and_a_manifest_without_them_is_refused(tmp_path):
    import orchestration.checkpoint.directory as ckpt_directory

    mgr, events, _ = _saved(tmp_path, [1, 2])
    path = tmp_path / "step_000002"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["chunk_bytes"] == ckpt_directory.DIGEST_CHUNK_BYTES
    assert mgr.latest().step == 2
    # A flipped byte is found by the chunked digests.
    _flip_byte(next((path / "dcp").glob("*.distcp")))
    events.clear()
    assert mgr.latest().step == 1
    assert [n for n, _ in events] == ["checkpoint_corrupt"] and "sha256 mismatch" in events[0][1]["reason"]
    first = tmp_path / "step_000001" / MANIFEST
    saved = json.loads(first.read_text())
    first.write_text(json.dumps({**saved, "chunk_bytes": "64MiB"}))
    with pytest.raises(CheckpointError, match="chunk_bytes"):
        mgr.verify(tmp_path / "step_000001")
    first.write_text(json.dumps({k: v for k, v in saved.items() if k != "chunk_bytes"}))
    with pytest.raises(CheckpointError, match="chunk_bytes"):
        mgr.verify(tmp_path / "step_000001")


def test_save_reports_where_its_time_went(tmp_path):
    mgr, _, _ = _saved(tmp_path, [1])
    timing = mgr.last_save_timing
    assert set(timing) == {"state_s", "write_s", "hash_s", "finalize_s", "hashed_bytes"}
    assert all(timing[k] >= 0 for k in timing)
    # one rank hashes every file of the checkpoint (the manifest's own listing)
    manifest = json.loads((tmp_path / "step_000001" / MANIFEST).read_text())
    assert timing["hashed_bytes"] == sum(meta["size"] for meta in manifest["files"].values()) > 0


def test_io_threads_share_the_allowed_cpus_among_the_nodes_ranks(monkeypatch):
    import orchestration.checkpoint.directory as ckpt_module

    monkeypatch.setattr(ckpt_module.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ckpt_module.io_threads() == 8  # capped
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ckpt_module.io_threads() == 4  # 32 CPUs over 8 ranks
    monkeypatch.setattr(ckpt_module.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert ckpt_module.io_threads() == 1  # never 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert ckpt_module.io_threads() == 3  # Ray's cpus_per_worker=3 through affinity, not the host's cores
