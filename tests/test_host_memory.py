"""Host staging buffers (orchestration.host_memory): registration bookkeeping, reuse, background preparation.

cudaHostRegister cannot run on a machine without CUDA: the page-locking calls are replaced by a recorder here (a
mock of the CUDA runtime, nothing else); the real calls run in tests/test_fp8_gpu.py on the GPU.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import orchestration.host_memory as hm
from orchestration.checkpoint import CheckpointManager, stage_to_host
from orchestration.host_memory import HostStaging, tensor_specs


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


def test_buffers_are_registered_once_for_their_exact_bytes_and_unregistered_when_replaced():
    rec = Recorder()
    st = HostStaging(rec.lock, rec.unlock)
    like = torch.empty(3, 5, dtype=torch.bfloat16)
    a = st.buffer("/model/w", like, pin=True)
    assert a.shape == like.shape and a.dtype == torch.bfloat16 and not a.is_pinned()
    assert rec.locked == {a.data_ptr(): 3 * 5 * 2}  # exact size, no power-of-two rounding
    assert torch.count_nonzero(a) == 0  # pages touched (zeroed) before registering
    assert st.buffer("/model/w", like, pin=True).data_ptr() == a.data_ptr()  # reused: no second registration
    assert len(rec.log) == 1
    b = st.buffer("/model/w", torch.empty(4, 5, dtype=torch.bfloat16), pin=True)  # new shape: replaced
    assert rec.log[1:] == [("unlock", a.data_ptr(), 0), ("lock", b.data_ptr(), 40)]
    st.buffer("/model/bias", torch.empty(0), pin=True)  # empty: nothing to register
    st.buffer("/extra/cpu_tensor", torch.empty(7), pin=False)  # a host source needs no page-locking
    assert rec.locked == {b.data_ptr(): 40}
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
    assert threading.get_ident() not in rec.threads and len(rec.locked) == 3
    ptrs = {p: t.data_ptr() for p, t in st.buffers.items()}
    st.prepare(specs)  # nothing left to do: no thread, no new registration
    assert not st.preparing() and len(rec.log) == 3
    # stage_to_host walks the same key paths, so it finds the prepared buffers (pin decided by the source: CPU here,
    # so the prepared page-locked buffers, which also fit, are kept)
    staged = stage_to_host(tree, st)
    assert {p: t.data_ptr() for p, t in st.buffers.items()} == ptrs
    assert torch.equal(staged["model"]["w"], tree["model"]["w"]) and torch.equal(staged["optim"]["state"]["0"]["m"],
                                                                                 tree["optim"]["state"]["0"]["m"])


def test_a_failed_preparation_is_raised_by_the_next_use_and_registration_failure_falls_back(monkeypatch):
    rec = Recorder()

    def broken_lock(ptr, nbytes):
        raise OSError("no more locked memory (ulimit -l)")

    st = HostStaging(lambda p, n: (_ for _ in ()).throw(MemoryError("host RAM exhausted")), rec.unlock)
    st.prepare([("/model/w", torch.Size([4]), torch.float32, True)])
    with pytest.raises(RuntimeError, match="preparing the checkpoint's host buffers failed: MemoryError: host RAM"):
        st.buffer("/model/w", torch.empty(4), pin=True)
    # registration refused (an unsupported platform, a locked-memory limit): torch's pinned allocator instead
    fallback_calls = []
    monkeypatch.setattr(hm, "torch_pinned_empty", lambda shape, dtype: fallback_calls.append(shape) or
                        torch.zeros(shape, dtype=dtype))
    st2 = HostStaging(broken_lock, rec.unlock)
    buf = st2.buffer("/model/w", torch.empty(2, 3), pin=True)
    assert buf.shape == (2, 3) and fallback_calls == [torch.Size([2, 3])] and st2.fallbacks == 1
    st2.release()
    assert rec.log == []  # nothing was registered, so nothing is unregistered


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
