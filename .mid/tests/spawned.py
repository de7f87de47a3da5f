"""The life of one rank in a test that spawns real torch.distributed processes.

`rank_process_group` joins the group, and when the rank's work succeeded it meets the other ranks at a barrier,
destroys the group and leaves through os._exit(0), skipping interpreter finalization. Why: CI once saw a spawned
gloo rank die with SIGABRT ("terminate called without an active exception", no Python traceback) after its work,
the signature of a C++ thread still joinable when libtorch's objects are torn down at exit (pytorch #179291
describes the same teardown race). The results are already on disk by then; finalization has nothing left to do.
A rank that raises still destroys its group and re-raises, so mp.spawn reports the real traceback."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

# Far below gloo's 30-minute default: a rank waiting on a dead peer must fail the test, not stall CI.
RANK_TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    """A TCP port free on loopback now (for a process group's or a Ray head's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_rank() -> NoReturn:
    """End a spawned rank whose work succeeded: barrier, destroy the group, exit without finalization (see above)."""
    dist.barrier()  # no rank tears down while a peer still talks to it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def rank_process_group(backend: str, init_method: str, rank: int, world_size: int,
                       timeout: timedelta = RANK_TIMEOUT) -> Iterator[None]:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()
