"""Host staging buffers (orchestration.checkpoint.host_memory): registration bookkeeping, reuse, background preparation.

cudaHostRegister cannot run on a machine without CUDA: the page-locking calls are replaced by a recorder here (a
mock of the CUDA runtime, nothing else); the real calls run in tests/test_host_memory_gpu.py on the GPU.
"""

from __future__ import annotations

import gc
import threading

import torch

import orchestration.checkpoint.host_memory as hm
from orchestration.checkpoint.host_memory import HostStaging, tensor_specs
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.checkpoint.state import stage_to_host


class Recorder:
    def __init__(self, fail: bool = False):
        self.locked: dict[int, int] = {}
        self.log: list[tuple[str, int, int]] = []
        self.threads: set[int] = set()
        self.fail = fail

    def lock(self, ptr: int, nbytes: int) -> None:
        self.threads.add(threading.get_ident())
        if self.fail:
            raise RuntimeError("cudaHostRegister failed with CUDA error 1")
        assert ptr not in self.locked, "registered twice"
        self.locked[ptr] = nbytes
        self.log.append(("lock", ptr, nbytes))

    def unlock(self, ptr: int) -> None:
        assert ptr in self.locked, "unregistering memory that was never registered"
        del self.locked[ptr]
        self.log.append(("unlock", ptr, 0))


def test_one_registration_of_whole_pages_per_allocation_and_reuse_while_shapes_hold():
    rec = Recorder()
    st = HostStaging(rec.lock, rec.unlock)
    specs = [("/model/w", torch.Size([3, 5]), torch.bfloat16, True),
             ("/model/b", torch.Size([5]), torch.float32, True),
             ("/optim/step", torch.Size([]), torch.float32, False),
             ("/model/empty", torch.Size([0]), torch.float32, True)]
    st.ensure(specs)
    w, b = st.buffers["/model/w"], st.buffers["/model/b"]
    assert w.shape == (3, 5) and w.dtype == torch.bfloat16 and b.shape == (5,) and b.dtype == torch.float32
    # one registration covering both page-locked buffers, page-aligned, whole pages (no page shared with a neighbour)
    ((ptr, nbytes),) = rec.locked.items()
    assert ptr % hm.PAGE == 0 and nbytes % hm.PAGE == 0
    for buf in (w, b):
        # the views' storage starts where the registration does: is_pinned() (which asks about a storage's first
        # byte) then sees it
        assert buf.untyped_storage().data_ptr() == ptr
        assert ptr <= buf.data_ptr() and buf.data_ptr() + buf.numel() * buf.element_size() <= ptr + nbytes
        assert buf.data_ptr() % hm.ALIGN == 0 and torch.count_nonzero(buf) == 0  # touched (zeroed) first
    assert st.last_alloc["new_buffers"] == 4 and st.buffers["/optim/step"].shape == ()
    # buffers do not overlap: writing one leaves the other alone
    w.fill_(1.5)
    assert torch.count_nonzero(b) == 0
    st.ensure(specs)  # everything fits: nothing allocated, nothing registered
    assert st.last_alloc == {} and len(rec.log) == 1 and st.buffers["/model/w"].data_ptr() == w.data_ptr()
    # a new shape for one path: a new arena for it; the old arena stays registered while /model/b lives in it
    w2 = st.buffer("/model/w", torch.empty(4, 5, dtype=torch.bfloat16), pin=True)
    assert len(rec.locked) == 2 and ptr in rec.locked and w2.shape == (4, 5)
    st.buffer("/model/b", torch.empty(6), pin=True)  # the last buffer of the first arena moves: it is unregistered
    assert ptr not in rec.locked and len(rec.locked) == 2
    st.release()
    assert rec.locked == {} and len(st) == 0


def test_prepare_allocates_in_a_thread_and_the_next_save_uses_those_buffers():
    rec = Recorder()
    st = HostStaging(rec.lock, rec.unlock)
    tree = {"model": {"w": torch.randn(8, 4), "b": torch.randn(4)}, "optim": {"state": {"0": {"m": torch.randn(8)}}}}
    specs = [(p, s, d, True) for p, s, d, _ in tensor_specs(tree)]
    assert [p for p, *_ in specs] == ["/model/w", "/model/b", "/optim/state/0/m"]
    st.prepare(specs)
    st.wait_prepared()
    assert threading.get_ident() not in rec.threads and len(rec.locked) == 1
    ptrs = {p: t.data_ptr() for p, t in st.buffers.items()}
    st.prepare(specs)  # nothing left to do: no thread, no new registration
    assert not st.preparing() and len(rec.log) == 1
    # stage_to_host walks the same key paths and finds the prepared buffers (page-locked ones also fit a CPU source)
    staged = stage_to_host(tree, st)
    assert {p: t.data_ptr() for p, t in st.buffers.items()} == ptrs
    assert torch.equal(staged["model"]["w"], tree["model"]["w"])
    assert torch.equal(staged["optim"]["state"]["0"]["m"], tree["optim"]["state"]["0"]["m"])


def test_a_failed_preparation_is_recorded_and_the_next_use_allocates_and_registration_failure_falls_back(
        monkeypatch):
    rec = Recorder()
    calls = []

    def out_of_memory_once(ptr, nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            raise MemoryError("host RAM exhausted")
        rec.lock(ptr, nbytes)

    st = HostStaging(out_of_memory_once, rec.unlock)
    st.prepare([("/model/w", torch.Size([4]), torch.float32, True)])
    buf = st.buffer("/model/w", torch.empty(4), pin=True)  # the save allocates what the preparation could not
    assert st.last_prepare_error == "MemoryError: host RAM exhausted"
    assert len(calls) == 2 and rec.locked and buf.shape == (4,)
    # registration refused (an unsupported platform, a locked-memory limit): torch's pinned allocator instead
    fallback_calls = []
    monkeypatch.setattr(hm, "torch_pinned_empty", lambda nbytes: fallback_calls.append(nbytes) or
                        torch.zeros(nbytes, dtype=torch.uint8))
    rec2 = Recorder()
    st2 = HostStaging(Recorder(fail=True).lock, rec2.unlock)
    buf = st2.buffer("/model/w", torch.empty(2, 3), pin=True)
    assert buf.shape == (2, 3) and fallback_calls == [hm.PAGE] and st2.fallbacks == 1
    st2.release()
    assert rec2.log == []  # nothing was registered, so nothing is unregistered

    def no_binding(ptr, nbytes):  # a build whose runtime binding lacks the call (ROCm is expected to have it)
        raise AttributeError("module has no attribute 'cudaHostRegister'")

    st3 = HostStaging(no_binding, rec2.unlock)
    assert st3.buffer("/w", torch.empty(5), pin=True).shape == (5,) and st3.fallbacks == 1


def test_garbage_collection_unregisters():
    rec = Recorder()
    st = HostStaging(rec.lock, rec.unlock)
    st.buffer("/a", torch.empty(16), pin=True)
    st.buffer("/b", torch.empty(32), pin=True)
    assert len(rec.locked) == 2
    del st
    gc.collect()
    assert rec.locked == {}


def test_checkpoint_manager_prepares_then_saves_into_the_prepared_buffers(tmp_path):
    from tests.test_checkpoint import assert_states_bit_identical, build, full_state, train_steps

    model, opt, sched = build(seed=0)
    train_steps(model, opt, sched, 1)
    mgr = CheckpointManager(tmp_path / "ck")
    n = mgr.prepare_staging(model, opt)
    mgr._staging.wait_prepared()
    ptrs = {p: t.data_ptr() for p, t in mgr._staging.buffers.items()}
    assert n == len(ptrs) > 0
    want = full_state(model, opt)
    mgr.save(1, model, opt, sched, background=True)
    assert mgr.wait() is not None
    assert {p: t.data_ptr() for p, t in mgr._staging.buffers.items()} == ptrs
    fresh, fresh_opt, fresh_sched = build(seed=5)
    train_steps(fresh, fresh_opt, fresh_sched, 1)
    mgr.load(mgr.latest(), fresh, fresh_opt, fresh_sched)
    assert_states_bit_identical(full_state(fresh, fresh_opt), want)


def test_touch_pages_zeroes_every_chunk_from_several_threads():
    region = torch.full(((64 << 20) + 12345,), 7, dtype=torch.uint8)  # not a multiple of the chunk size
    hm.touch_pages(region, threads=3)
    assert torch.count_nonzero(region) == 0
    small = torch.full((100,), 7, dtype=torch.uint8)
    hm.touch_pages(small, threads=3)
    assert torch.count_nonzero(small) == 0


def test_page_locking_runs_in_a_thread_of_its_own_and_a_failed_unregistration_keeps_the_memory():
    rec = Recorder()
    st = HostStaging(rec.lock, rec.unlock)
    st.buffer("/a", torch.empty(8), pin=True)  # from the training thread, registered from another one
    assert rec.locked and threading.get_ident() not in rec.threads

    def failing_unlock(ptr):
        raise RuntimeError("cudaHostUnregister failed with CUDA error 1")

    st2 = HostStaging(Recorder().lock, failing_unlock)
    st2.buffer("/a", torch.empty(8), pin=True)
    storage = st2._arenas[0].storage
    before = len(hm._KEPT_REGISTERED)
    st2.release()  # never frees memory that may still be registered
    assert len(hm._KEPT_REGISTERED) == before + 1 and hm._KEPT_REGISTERED[-1] is storage
