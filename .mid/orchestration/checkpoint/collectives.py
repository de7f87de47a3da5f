"""The few collectives of a checkpoint save or search: every rank learns any rank's error and raises with
it, so no rank is left waiting in the next collective."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from orchestration.checkpoint.directory import CheckpointError


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist_on() else 1


def sync_errors(error: str | None, what: str, group: Any = None) -> None:
    """All ranks learn whether any rank failed, and all raise together (no rank is left waiting)."""
    if _group_size(group) > 1:
        errors: list = [None] * _group_size(group)
        dist.all_gather_object(errors, error, group=group)
    else:
        errors = [error]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed: {detail}")


def broadcast_from_rank0(obj: Any, group: Any = None) -> Any:
    if _group_size(group) > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return obj


def gather_to_all(obj: Any, group: Any = None) -> list:
    if _group_size(group) > 1:
        out: list = [None] * _group_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return [obj]
