"""The worker's process group and device: joined once at the start of each worker-group lifetime (Ray Train has
already formed the group; torchrun has not), and the loopback store of the single-machine cluster."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def gpu_vendor(self) -> str | None:
        """"cuda" or "rocm" on a GPU (ROCm builds of torch expose HIP devices through torch.cuda), None on CPU."""
        if self.device.type != "cuda":
            return None
        return "rocm" if torch.version.hip is not None else "cuda"


def pick_device(requested: str, local_rank: int) -> torch.device:
    """cpu | cuda | rocm | auto. ROCm builds of torch expose HIP devices through the torch.cuda API."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested in ("cuda", "rocm", "auto") and torch.cuda.is_available():
        is_hip = torch.version.hip is not None
        if requested == "cuda" and is_hip:
            raise RuntimeError("cluster.device=cuda but this torch build is ROCm; use cluster.device=rocm or auto")
        if requested == "rocm" and not is_hip:
            raise RuntimeError("cluster.device=rocm but this torch build is CUDA; use cluster.device=cuda or auto")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if requested == "auto":
        return torch.device("cpu")
    raise RuntimeError(f"cluster.device={requested} but no GPU is visible to this worker")


def backend_for(device: torch.device) -> str:
    # RCCL is reached through the "nccl" backend name on ROCm builds of torch.
    return "nccl" if device.type == "cuda" else "gloo"


def torchrun_store_prefix(env: Mapping[str, str]) -> str | None:
    """The key prefix that keeps this torchrun attempt's process group apart from the attempts before it in the
    agent's TCPStore, or None when torchrun's agent hosts no store for the workers (not under torchrun, or torchrun
    started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: then each attempt's rank 0 hosts a new store on a new port).

    torchrun (torch 2.13) keeps ONE TCPStore in its agent for all the attempts of a run (the dynamic rendezvous makes
    its server once and hands every attempt the same MASTER_PORT), and init_process_group's env:// keys
    ("default_pg/0/...": each rank's gloo address, NCCL's unique id) are the same in every attempt. After a
    --max-restarts restart, the rank that gets there first reads the dead attempt's addresses from them: gloo
    "connection refused" to the previous attempt's peer, and the restart dies (pytorch issue 135712, which also says
    why torch does not prefix them with TORCHELASTIC_RESTART_COUNT: on several nodes the agents' counts can differ).
    On one node there is one agent, whose restart count numbers the attempts alike for every rank: it prefixes the
    keys. On several nodes with restarts there is no such number: refused, with what to change."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    max_restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if nodes > 1 and max_restarts > 0:
        raise ValueError(f"torchrun on {nodes} nodes with --max-restarts={max_restarts} keeps one TCPStore for every "
                         "restart, and a restarted group meets the dead one's addresses there (pytorch issue 135712): "
                         "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, or with "
                         "--max-restarts=0")
    return f"elastic_fp8/torchrun_attempt{int(env.get('TORCHELASTIC_RESTART_COUNT', '0'))}"


def init_distributed(requested_device: str, timeout_s: float = 600.0) -> DistInfo:
    """Join (or reuse) the default process group. Ray Train's TorchTrainer already created one; torchrun did not."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
    elif world_size > 1:
        timeout = timedelta(seconds=timeout_s)
        rendezvous = {}
        prefix = torchrun_store_prefix(os.environ)
        if prefix is not None:
            # torchrun's agent store, under this attempt's own keys (torchrun_store_prefix says why).
            agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                        is_master=False, timeout=timeout)
            rendezvous = {"store": dist.PrefixStore(prefix, agent_store), "rank": rank, "world_size": world_size}
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                **rendezvous)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def is_loopback_host(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keep_store_on_loopback() -> None:
    """Make rank 0's torch.distributed store listen on the loopback address it is reached at, when that address is
    loopback (the embedded single-machine cluster: MASTER_ADDR 127.0.0.1). torch's env:// rendezvous starts the
    store's server on every interface whatever MASTER_ADDR says, and it answers any client without authentication;
    a socket bound to MASTER_ADDR and handed to the store (TCPStore's master_listen_fd) keeps it on loopback. Ray
    Train creates the process group before the training function runs, so this wraps the function its env://
    rendezvous calls (torch.distributed.rendezvous._create_c10d_store) in every worker process (Ray's
    worker_process_setup_hook); any other case goes to torch's own. Idempotent."""
    import importlib
    import socket

    # The module itself: `from torch.distributed import rendezvous` gives the function of that name.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "keeps_loopback", False):
        return

    def create_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        agent_store = getattr(rendezvous, "_torchelastic_use_agent_store", lambda: False)()
        if rank != 0 or agent_store or not is_loopback_host(hostname):
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((hostname, port))
        listener.listen(1024)
        return dist.TCPStore(hostname, port, world_size, True, timeout, multi_tenant=True,
                             master_listen_fd=listener.detach(), use_libuv=use_libuv)

    create_store.keeps_loopback = True  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = create_store
