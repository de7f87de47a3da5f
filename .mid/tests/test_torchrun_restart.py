"""A torchrun --max-restarts restart forms its process group again (orchestration.training.process_group).

torchrun's agent keeps one TCPStore for all the attempts of a launch, and init_process_group's keys are the same in
every attempt: a restarted rank that gets there before its peers reads the dead attempt's gloo addresses. The worker
loop's rank 0 gets there last (it checks and opens the run directory first). Whether gloo then fails depends on which
rank of the pair dials (gloo orders the two addresses; the other rank waits to be dialled): when the restarted rank 1
dials the dead rank 0's address, "Gloo connectFullMesh failed ... timed out connecting: SO_ERROR: Connection refused"
(benchmarks/multi_gpu.py's torchrun run with checkpoint.keep_last=1: 4 of 5 runs before the fix). These tests show
the stale address waiting in the store for a restarted rank under env://, none under the attempt's own key prefix,
and the restarted group forming with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from orchestration.training.process_group import torchrun_store_prefix
from tests.conftest import REPO


def test_store_prefix_numbers_the_attempts_of_one_node():
    one_node = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert torchrun_store_prefix({**one_node, "TORCHELASTIC_RESTART_COUNT": "0"}) == "elastic_fp8/torchrun_attempt0"
    assert torchrun_store_prefix({**one_node, "TORCHELASTIC_RESTART_COUNT": "2"}) == "elastic_fp8/torchrun_attempt2"
    # not under torchrun, or torchrun without the shared store (each attempt's rank 0 hosts a new one): no prefix
    assert torchrun_store_prefix({}) is None
    assert torchrun_store_prefix({**one_node, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    # several nodes: fine without restarts, refused with them (the agents' restart counts can differ)
    many = {**one_node, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert torchrun_store_prefix({**many, "TORCHELASTIC_MAX_RESTARTS": "0"}) == "elastic_fp8/torchrun_attempt0"
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        torchrun_store_prefix(many)


def test_torchrun_on_several_nodes_with_restarts_is_refused_before_anything_is_written(tmp_path, isolated_env):
    env = {**isolated_env, "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    proc = subprocess.run([sys.executable, "-m", "orchestration.driver.torchrun", f"run_root={tmp_path}",
                           "model=debug_dense", "logging.wandb=false"], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[0], proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())


# Each attempt: rank 0 comes 5 s late (as the worker loop's rank 0, which opens the run directory first), both ranks
# form the group and all-reduce (env:// only in the first attempt); in the first attempt rank 1 then dies. Writes what
# each rank of each attempt saw.
_WORKER = """
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from orchestration.training.process_group import init_distributed, torchrun_store_prefix

rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
probe = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=False,
                      timeout=timedelta(seconds=30))
# where the default group's gloo context (group "0", device "cpu", context 0) keeps rank 0's address
namespace = "default_pg" if {plain} else torchrun_store_prefix(os.environ)
seen = {{"port": os.environ["MASTER_PORT"], "earlier_attempt_key": probe.check(["probe/attempt0"]),
        "rank0_address_before_rank0_started": probe.check([namespace + "/0//cpu//0/0"])}}
if rank == 0:
    probe.set("probe/attempt0" if attempt == 0 else "probe/later", "1")
    time.sleep(5)
if {plain} and attempt == 1:
    # what env:// would connect to is recorded above; forming the group here fails or not by gloo's pair order, and
    # a failure waits out gloo's connect retries (164 s once): not run
    with open(os.path.join({out!r}, f"attempt{{attempt}}_rank{{rank}}.json"), "w") as f:
        json.dump(seen, f)
    os._exit(0)
try:
    if {plain}:
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    else:
        init_distributed("cpu", timeout_s=30)
    total = torch.ones(1)
    dist.all_reduce(total)
    seen["sum"] = total.item()
except Exception as exc:
    seen["error"] = str(exc)[:300]
with open(os.path.join({out!r}, f"attempt{{attempt}}_rank{{rank}}.json"), "w") as f:
    json.dump(seen, f)
if "error" in seen or (attempt == 0 and rank == 1):
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def _restart_once(tmp_path, env, plain: bool) -> dict:
    out = tmp_path / ("plain" if plain else "prefixed")
    out.mkdir()
    script = tmp_path / f"worker_{out.name}.py"
    script.write_text(textwrap.dedent(_WORKER.format(repo=str(REPO), out=str(out), plain=plain)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--max-restarts=1", "--monitor-interval=0.1", str(script)], check=False, cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return {"returncode": proc.returncode, "seen": seen, "log": proc.stderr[-3000:]}


def test_a_restarted_rank_finds_the_dead_groups_address_under_env_init_not_under_its_prefix(tmp_path, isolated_env):
    plain = _restart_once(tmp_path, isolated_env, plain=True)
    prefixed = _restart_once(tmp_path, isolated_env, plain=False)
    for run in (plain, prefixed):
        seen = run["seen"]
        # the cause: the second attempt talks to the same agent store, which still holds the first attempt's keys
        assert seen["attempt0_rank0"]["sum"] == 2.0 and seen["attempt0_rank1"]["sum"] == 2.0, run
        assert seen["attempt1_rank1"]["port"] == seen["attempt0_rank1"]["port"], run
        assert seen["attempt1_rank1"]["earlier_attempt_key"] is True, run
    # env:// keys: the restarted rank 1 finds the dead rank 0's gloo address before the new rank 0 has started
    assert plain["seen"]["attempt1_rank1"]["rank0_address_before_rank0_started"] is True, plain
    # the attempt's own prefix: nothing there until the new rank 0 writes it; the restarted group forms
    assert prefixed["seen"]["attempt1_rank1"]["rank0_address_before_rank0_started"] is False, prefixed
    assert prefixed["returncode"] == 0, prefixed
    assert prefixed["seen"]["attempt1_rank0"]["sum"] == 2.0 and prefixed["seen"]["attempt1_rank1"]["sum"] == 2.0
