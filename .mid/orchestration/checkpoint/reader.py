"""Reading one checkpoint into a model: the DCP tensors resharded to the current layout (any world size, FSDP2 or
plain), the non-tensor state, the scheduler and this rank's RNG states. The manager (manager.py) finds and verifies
the checkpoint first and reports the load; the counterpart of writer.py."""

from __future__ import annotations

import json
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

from orchestration.checkpoint.directory import (
    DCP_DIR,
    EXTRA_STATE,
    SCHEDULER,
    STATE_META,
    CheckpointError,
    CheckpointInfo,
    io_threads,
    rng_file_name,
)
from orchestration.checkpoint.rng import derive_rng_seed, restore_rng_state, seed_all_rngs
from orchestration.checkpoint.state import (
    ParallelFileSystemReader,
    dcp_failure_summary,
    merge_trees,
    model_and_optimizer_state,
    regroup_param_groups,
    split_tensors,
)


def read_into(info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
              scheduler: Any | None, *, rank: int, world_size: int, seed: int) -> tuple[dict, str]:
    """Load the verified checkpoint `info` into model/optimizer/scheduler in place; returns (its extra state, how
    the RNG was set: "restored" at the world size it was saved with, else "derived" from (seed, step, rank)).
    Runs DCP's collectives when a process group is initialized: call it on every rank."""
    path = info.path
    if scheduler is not None and not (path / SCHEDULER).is_file():
        raise CheckpointError(f"checkpoint {path} was saved without a scheduler; pass scheduler=None or "
                              f"resume from a checkpoint that has one")
    try:
        saved_rest = torch.load(path / STATE_META, weights_only=True, map_location="cpu")
        extra_state = json.loads((path / EXTRA_STATE).read_text(encoding="ascii"))
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE_META}/{EXTRA_STATE}: {e}") from e
    if optimizer is not None and "optim" not in saved_rest:
        raise CheckpointError(f"checkpoint {path} has no optimizer state; pass optimizer=None to load "
                              f"the model only")
    dest = model_and_optimizer_state(model, optimizer)
    tensors, _ = split_tensors(dest)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            # in place, resharded to the current layout; the rank's files read in threads
            dcp.load(tensors, storage_reader=ParallelFileSystemReader(path / DCP_DIR, io_threads()))
        except CheckpointException as e:  # a BaseException: would escape `except Exception` handlers
            raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: "
                                  f"{dcp_failure_summary(e)}; a run resumes with the model settings it was "
                                  "saved with (model.name, model.overrides), or choose a new run_name") from None
    merged = merge_trees(saved_rest, tensors)
    if optimizer is None:
        set_model_state_dict(model, merged["model"])
    else:
        merged["optim"]["param_groups"] = regroup_param_groups(merged["optim"]["param_groups"],
                                                               dest["optim"]["param_groups"])
        set_state_dict(model, optimizer, model_state_dict=merged["model"], optim_state_dict=merged["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=True, map_location="cpu"))
    if info.world_size == world_size:
        restore_rng_state(torch.load(path / rng_file_name(rank), weights_only=True, map_location="cpu"))
        rng = "restored"
    else:
        seed_all_rngs(derive_rng_seed(seed, info.step, rank))
        rng = "derived"
    return extra_state, rng
