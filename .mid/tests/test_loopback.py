"""The embedded single-machine cluster keeps every listener of the job's process group on loopback: rank 0's
torch.distributed store (orchestration.training.process_group.keep_store_on_loopback, installed in every Ray worker by
its setup hook) and gloo's sockets (GLOO_SOCKET_IFNAME=lo, set by the driver for an embedded cluster). Two real gloo
ranks rendezvous through env:// as Ray Train's do; the listening sockets of both processes are read from /proc.
Without the store's wrapper the same ranks listen on every interface: the check can fail."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, repo_on_path
from tests.spawned import free_port
from tests.test_hardening_ray import _is_loopback, listening_sockets

RANK = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
if sys.argv[1] == "1":
    from orchestration.training.process_group import keep_store_on_loopback
    keep_store_on_loopback()
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == 2.0
Path(sys.argv[2], f"ready{dist.get_rank()}").touch()
while not Path(sys.argv[2], "done").exists():
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("patched", [True, False])
def test_process_group_listens_on_loopback_only(tmp_path, patched):
    env = {**repo_on_path(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, "1" if patched else "0", str(tmp_path)], cwd=REPO,
                              env={**env, "RANK": str(r)}, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        deadline = time.time() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert time.time() < deadline and all(p.poll() is None for p in ranks), [p.stderr.read() for p in ranks]
            time.sleep(0.05)
        sockets = listening_sockets([p.pid for p in ranks])
    finally:
        (tmp_path / "done").touch()
        for p in ranks:
            p.wait(timeout=60)
    assert [p.returncode for p in ranks] == [0, 0], [p.stderr.read() for p in ranks]
    store = [s for s in sockets if s[3] == int(env["MASTER_PORT"])]
    assert len(store) == 1 and store[0][0] == ranks[0].pid, sockets  # rank 0 hosts the store
    exposed = [s for s in sockets if not _is_loopback(s[2])]
    if patched:
        assert sockets and not exposed, exposed
    else:
        assert [s[3] for s in exposed] == [int(env["MASTER_PORT"])], sockets  # torch's own store: every interface
