"""Background checkpoint saves (CheckpointManager.save(background=True), checkpoint.async_save): the checkpoint holds
the state at the moment save() returned even though training goes on while it is written; errors surface at the
next call; a process that dies mid-write leaves the previous checkpoint as the newest; two FSDP2 ranks write in the
background while their training threads run collectives on the default group."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orchestration.checkpoint.directory import CheckpointError, verify_checkpoint
from orchestration.checkpoint.manager import CheckpointManager
from tests.spawned import free_port, rank_process_group
from tests.test_checkpoint import assert_states_bit_identical, build, build_fsdp, full_state, halving, train_steps

ROOT = Path(__file__).resolve().parents[1]


def test_background_save_holds_the_state_of_its_step(tmp_path):
    events: list = []
    mgr = CheckpointManager(tmp_path / "ck", event_sink=lambda name, payload: events.append((name, payload)))
    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 2)
    want = full_state(model, opt)
    path = mgr.save(2, model, opt, sched, {"data": {"next_index": 8}}, background=True)
    train_steps(model, opt, sched, 3, offset=2)  # training goes on while the thread writes
    moved = full_state(model, opt)
    assert not torch.equal(moved["model"]["layers.0.weight"], want["model"]["layers.0.weight"])
    step, done_path, timing = mgr.wait()
    assert (step, done_path) == (2, path)
    assert {"state_s", "stage_s", "write_s", "hash_s", "finalize_s", "background_s"} <= timing.keys()
    assert timing["hashed_bytes"] > 0
    assert ("checkpoint_saved", {"step": 2, "path": str(path), "good": False}) in events
    assert mgr.wait() is None  # reported once
    assert verify_checkpoint(path).step == 2

    fresh, fresh_opt, fresh_sched = build(seed=7)
    train_steps(fresh, fresh_opt, fresh_sched, 1)  # optimizer state exists before load (see load's docstring)
    extra = mgr.load(mgr.latest(), fresh, fresh_opt, fresh_sched)
    assert extra == {"data": {"next_index": 8}}
    assert_states_bit_identical(full_state(fresh, fresh_opt), want)
    assert fresh_sched.state_dict()["last_epoch"] == 2 and fresh_sched.get_last_lr() == [0.05 * halving(2)]


def test_next_save_waits_reuses_the_host_buffers_and_retention_runs(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2, keep_good=1)
    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 1)
    mgr.save(0, model, opt, sched, background=True)
    buffers = {k: v.data_ptr() for k, v in mgr._staging.buffers.items()}
    for step in (1, 2, 3):
        train_steps(model, opt, sched, 1, offset=step)
        mgr.save(step, model, opt, sched, background=True)  # joins the previous one first
        assert {k: v.data_ptr() for k, v in mgr._staging.buffers.items()} == buffers
    # latest() joins the save in flight: step 3 is there, retention (in the thread) kept the newest two
    assert mgr.latest().step == 3
    assert [s for s, _ in mgr.finalized()] == [3, 2]


def test_a_staged_synchronous_save_equals_a_direct_one(tmp_path):
    """stage=True without background: written from the host copy at once; the same tensors as a direct save."""
    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 2)
    staged = CheckpointManager(tmp_path / "staged")
    staged.save(2, model, opt, sched, stage=True)
    assert staged._staging.buffers and staged.wait() is None  # nothing in flight, nothing to report
    assert {"stage_s", "write_s"} <= staged.last_save_timing.keys()
    CheckpointManager(tmp_path / "direct").save(2, model, opt, sched)
    loaded = []
    for root in ("staged", "direct"):
        fresh, fresh_opt, fresh_sched = build(seed=3)
        train_steps(fresh, fresh_opt, fresh_sched, 1)
        mgr = CheckpointManager(tmp_path / root)
        mgr.load(mgr.latest(), fresh, fresh_opt, fresh_sched)
        loaded.append(full_state(fresh, fresh_opt))
    assert_states_bit_identical(loaded[0], loaded[1])
    assert_states_bit_identical(loaded[0], full_state(model, opt))


def test_a_failed_background_write_raises_at_the_next_call_and_keeps_older_checkpoints(tmp_path, monkeypatch):
    import orchestration.checkpoint.writer as ck

    mgr = CheckpointManager(tmp_path / "ck")
    model, opt, sched = build(seed=0)
    mgr.save(0, model, opt, sched)

    def disk_full(*args, **kwargs):  # the hashing pass reads the written files: a failing disk shows here
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "file_digests", disk_full)
    mgr.save(1, model, opt, sched, background=True)
    with pytest.raises(CheckpointError, match="background save of step 1.*No space left on device"):
        mgr.latest()
    monkeypatch.undo()
    assert mgr.latest().step == 0  # the failed one never became a step_ directory
    assert mgr.wait() is None  # the error was raised once


def _crash_mid_write_script(root: Path) -> str:
    return textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from torch import nn
        import orchestration.checkpoint.manager as ck
        import orchestration.checkpoint.writer as ck_writer

        model = nn.Linear(2048, 2048)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 2048)).sum().backward()
        opt.step()
        mgr = ck.CheckpointManager({str(root)!r})
        mgr.save(0, model, opt)
        real = ck_writer.file_digests
        def slow(*a, **k):  # hold the thread between the write and the manifest, where a crash hurts most
            print("WRITING", flush=True)
            time.sleep(30)
            return real(*a, **k)
        ck_writer.file_digests = slow
        mgr.save(1, model, opt, background=True)
        for _ in range(300):
            if any(p.name.startswith(".tmp-") for p in mgr.root.iterdir()) and mgr.save_in_flight(1):
                break
            time.sleep(0.01)
        time.sleep(0.5)
        os._exit(3)  # the process dies with the save in flight
    """)


def test_a_crash_with_a_save_in_flight_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", _crash_mid_write_script(root)], check=False, capture_output=True,
                          text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "WRITING" in proc.stdout
    assert any(p.name.startswith(".tmp-step_000001") for p in root.iterdir())  # the cut-short save
    mgr = CheckpointManager(root)  # a restart: rank 0 removes leftovers
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert mgr.latest().step == 0


def _fsdp_rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        mesh = init_device_mesh("cpu", (world,))
        model, opt, sched = build_fsdp(0, mesh)
        train_steps(model, opt, sched, 2, rank=rank, world=world)
        want = full_state(model, opt)
        mgr = CheckpointManager(root)
        mgr.save(2, model, opt, sched, {"step": 2}, background=True)
        # the training thread's collectives on the default group while the thread writes on its gloo group
        train_steps(model, opt, sched, 3, rank=rank, world=world, offset=2)
        for _ in range(20):
            dist.all_reduce(torch.ones(4))
        done = mgr.wait()
        fresh, fresh_opt, fresh_sched = build_fsdp(9, mesh)
        train_steps(fresh, fresh_opt, fresh_sched, 1, rank=rank, world=world)
        mgr.load(mgr.latest(collective=True), fresh, fresh_opt, fresh_sched)
        got = full_state(fresh, fresh_opt)
        if rank == 0:
            torch.save({"want": want, "got": got, "done_step": done[0]}, out)


@pytest.mark.slow
def test_fsdp2_two_ranks_save_in_the_background(tmp_path):
    out = tmp_path / "out.pt"
    mp.spawn(_fsdp_rank, args=(2, free_port(), str(tmp_path / "ck"), str(out)), nprocs=2, join=True)
    result = torch.load(out)
    assert result["done_step"] == 2
    assert_states_bit_identical(result["got"], result["want"])
    info = verify_checkpoint(tmp_path / "ck" / "step_000002")
    assert info.world_size == 2
    assert len([f for f in info.manifest["files"] if f.endswith(".distcp")]) >= 2  # both ranks wrote shards


def test_config_rejects_unknown_async_mode():
    from orchestration.config import ConfigError, JobConfig
    from orchestration.validation import validate

    job = JobConfig()
    job.checkpoint.async_save = "sometimes"
    with pytest.raises(ConfigError, match="checkpoint.async_save.*'auto', 'always', 'never'"):
        validate(job)



def test_mark_good_does_not_wait_for_a_save_in_flight_and_abandon_reports_it(tmp_path, monkeypatch):
    """Only rank 0 marks checkpoints good: waiting there (or raising the save's error there alone) would stall or
    desynchronize the ranks; the error comes at wait() instead. abandon() (the loop raised) waits a bounded time."""
    import threading

    import orchestration.checkpoint.directory as ck_directory
    import orchestration.checkpoint.writer as ck

    mgr = CheckpointManager(tmp_path / "ck")
    model, opt, sched = build(seed=0)
    mgr.save(0, model, opt, sched)
    release = threading.Event()

    def blocked_then_failing(*args, **kwargs):
        release.wait(30)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ck, "file_digests", blocked_then_failing)
    mgr.save(1, model, opt, sched, background=True)
    assert mgr.save_in_flight(1) and mgr.save_in_flight() and not mgr.save_in_flight(0)
    mgr.mark_good(0)  # returns while step 1 is still being written
    assert mgr.save_in_flight(1) and ck_directory.read_manifest(tmp_path / "ck" / "step_000000")["good"]
    assert mgr.abandon(0.05) == (1, False)  # still writing after the bounded wait
    release.set()
    assert mgr.abandon(30) == (1, False)  # finished, with its error: not finalized, and abandon does not raise
    monkeypatch.undo()
    assert mgr.wait() is None and mgr.latest().step == 0


def test_a_staging_failure_is_an_error_of_the_save(tmp_path, monkeypatch):
    import orchestration.checkpoint.writer as ck

    def no_pinned_memory(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    monkeypatch.setattr(ck, "stage_to_host", no_pinned_memory)
    mgr = CheckpointManager(tmp_path / "ck")
    model, opt, sched = build(seed=0)
    with pytest.raises(CheckpointError, match="copying the state of step 3 to host memory failed: rank 0: "
                                              "RuntimeError: CUDA error: out of memory"):
        mgr.save(3, model, opt, sched, background=True)
    assert not mgr.save_in_flight() and mgr.latest() is None


def test_parallel_reader_reads_each_file_in_its_own_thread_and_loads_bit_identical(tmp_path, monkeypatch):
    import threading

    import torch.distributed.checkpoint as dcp

    import orchestration.checkpoint.reader as ck
    import orchestration.checkpoint.writer as ck_writer

    monkeypatch.setattr(ck_writer, "io_threads", lambda: 4)  # the save writes 4 files,
    monkeypatch.setattr(ck, "io_threads", lambda: 4)  # the load reads them with 4 threads
    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 2)
    mgr = CheckpointManager(tmp_path / "ck")
    path = mgr.save(2, model, opt, sched)
    files = sorted(p.name for p in (path / ck.DCP_DIR).glob("*.distcp"))
    assert len(files) == 4
    seen: dict[str, set] = {}
    parent_read = dcp.FileSystemReader.read_data

    def recording_read(self, plan, planner):
        for item in plan.items:
            seen.setdefault(self.storage_data[item.storage_index].relative_path, set()).add(
                threading.current_thread().name)
        return parent_read(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", recording_read)
    fresh, fresh_opt, fresh_sched = build(seed=5)
    train_steps(fresh, fresh_opt, fresh_sched, 1)
    mgr.load(mgr.latest(), fresh, fresh_opt, fresh_sched)
    assert_states_bit_identical(full_state(fresh, fresh_opt), full_state(model, opt))
    assert sorted(seen) == files  # every file read, each by one call in one reader thread
    assert all(len(names) == 1 and next(iter(names)).startswith("checkpoint-read") for names in seen.values())
