"""orchestration.training.gc_policy: automatic GC off inside the loop, scheduled young collections, state restored."""

import gc
import weakref

import pytest

from orchestration.config import ConfigError, JobConfig
from orchestration.training.gc_policy import ManagedGc
from orchestration.validation import validate


class _Node:
    def __init__(self):
        self.other = None


def _make_cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_scheduled_collection_frees_cycles_only_when_due():
    assert gc.isenabled()
    with ManagedGc(every_steps=3) as managed:
        assert not gc.isenabled()
        ref = _make_cycle()
        # Steps 1 and 2 are not due: the unreachable cycle survives (automatic GC is off)...
        assert [managed.step(s) for s in (1, 2)] == [False, False]
        assert ref() is not None
        # ...step 3 is: a young-generation collection frees it.
        assert managed.step(3) is True
        assert ref() is None
        assert managed.collections == 1
    assert gc.isenabled()


def test_zero_keeps_automatic_gc_and_never_collects():
    with ManagedGc(every_steps=0) as managed:
        assert gc.isenabled()
        assert not any(managed.step(s) for s in range(1, 200))
        assert managed.collections == 0
    assert gc.isenabled()


def test_disabled_gc_stays_disabled_after_the_loop():
    gc.disable()
    try:
        with ManagedGc(every_steps=5):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_restores_gc_when_the_loop_raises():
    with pytest.raises(RuntimeError), ManagedGc(every_steps=5):
        raise RuntimeError("step failed")
    assert gc.isenabled()


def test_negative_interval_is_rejected():
    with pytest.raises(ValueError, match="every_steps must be >= 0"):
        ManagedGc(every_steps=-1)
    job = JobConfig()
    job.train.gc_every_steps = -2
    with pytest.raises(ConfigError, match="train.gc_every_steps"):
        validate(job)
