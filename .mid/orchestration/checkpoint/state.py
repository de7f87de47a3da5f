"""Model and optimizer state trees for DCP: tensors apart from the rest, host-memory copies for background
saves, and a threaded DCP reader."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from orchestration.checkpoint.host_memory import HostStaging, tensor_specs


def split_tensors(tree: dict) -> tuple[dict, dict]:
    """Split a nested state dict into (tensor leaves, everything else), both keeping the dict nesting.

    Lists and tuples (e.g. optimizer param_groups) count as non-tensor leaves. Empty dicts are dropped from the
    tensor side (DCP has nothing to write for them).
    """
    tensors: dict = {}
    rest: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub_tensors, sub_rest = split_tensors(value)
            if sub_tensors:
                tensors[key] = sub_tensors
            rest[key] = sub_rest
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            rest[key] = value
    return tensors, rest


def model_and_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """{"model": ..., "optim": ...} state dicts as DCP saves and loads them (FSDP2-aware); without an optimizer the
    model's alone."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def regroup_param_groups(saved: list[dict], current: list[dict]) -> list[dict]:
    """The saved optimizer param groups (parameters named by FQN) rearranged into the current optimizer's grouping,
    each current group with the settings (betas, weight decay, ...) its first parameter was saved with. The grouping
    follows the layout: one group per device mesh, all with the same settings (orchestration/training/optimizer.py),
    so expert parallelism adds a group that a checkpoint saved without it lacks. torch's set_optimizer_state_dict
    copies a saved group's settings into only one of the current groups holding its parameters and leaves the
    others without any (the next step fails on a missing 'betas'). Pure."""
    settings = {fqn: {k: v for k, v in group.items() if k != "params"} for group in saved for fqn in group["params"]}
    regrouped = []
    for group in current:
        first = next((settings[fqn] for fqn in group["params"] if fqn in settings), None)
        if first is None:  # none of its parameters saved: the strict load that follows names them
            first = {k: v for k, v in group.items() if k != "params"}
        regrouped.append({**first, "params": list(group["params"])})
    return regrouped


def tensor_leaves(tree: dict) -> list:
    """The non-dict leaves of a nested dict."""
    out = []
    for value in tree.values():
        out.extend(tensor_leaves(value) if isinstance(value, dict) else [value])
    return out


def merge_trees(base: dict, overlay: dict) -> dict:
    """Deep merge: keys of `overlay` win; nested dicts merge."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = value
    return out


def stage_to_host(tree: dict, staging: HostStaging, prefix: str = "") -> dict:
    """A copy of a nested dict of tensors in host memory, for a background save: each tensor (a DTensor's local
    shard, keeping its sharding spec) is copied into a CPU buffer of `staging` (kept from one save to the next),
    page-locked when the source is on a GPU so the copy is a DMA at full speed and non-blocking.

    The copies are queued on the current stream; the caller must synchronize (an event) before reading them on the
    host, and later kernels on that stream (the optimizer step) cannot overwrite the sources before they are done."""
    from torch.distributed.tensor import DTensor

    if not prefix:  # every missing buffer at once: the page-locked ones in one arena, one registration
        staging.ensure(tensor_specs(tree))
    out: dict = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}"
        if isinstance(value, dict):
            out[key] = stage_to_host(value, staging, path)
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        buf = staging.buffer(path, local)
        buf.copy_(local.detach(), non_blocking=local.is_cuda)
        # DTensor with a host-memory local shard and the source's spec (mesh, placements, global shape): DCP writes
        # it as the same shard of the same global tensor.
        out[key] = DTensor(buf, value._spec, requires_grad=False) if isinstance(value, DTensor) else buf
    return out


class ParallelFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with its files read in threads, one group of requests per file (DCP's reads them one file
    after the other, most of a resume's downtime - BENCHMARKS.md "Restart and recovery times").
    Each file's requests go through the parent's own read_data, so the format handling stays DCP's;
    the files' requests write disjoint destinations. Safe with DefaultLoadPlanner (resolve_tensor only looks up and
    narrows, commit_tensor does nothing, load_bytes assigns into existing containers); a custom planner that keeps
    state in those calls would need its own locking."""

    def __init__(self, path: str | os.PathLike, threads: int):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if self.threads <= 1 or len(per_file) <= 1:
            return super().read_data(plan, planner)
        read_one = super().read_data
        with ThreadPoolExecutor(min(self.threads, len(per_file)), thread_name_prefix="checkpoint-read") as pool:
            futures = [pool.submit(read_one, replace(plan, items=items), planner)
                       for items in per_file.values()]
            for f in futures:
                f.result().wait()  # raises the first failure, after the pool has finished the others
        return futures[0].result()




def dcp_failure_summary(exc: CheckpointException) -> str:
    """The causes of a DCP load failure, one per distinct message (e.g. 'Size mismatch ... for model.w'), without
    the per-rank tracebacks DCP's own message carries."""
    causes = []
    for failure in getattr(exc, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        text = f"{type(cause).__name__}: {cause}"
        if text not in causes:
            causes.append(text)
    return "; ".join(causes[:5]) or str(exc).splitlines()[0]
