"""What a worker tells Ray Train about a finished checkpoint (ray.train.report), and whether Ray copies it.

Ray Train's default report (CheckpointUploadMode.SYNC) copies the reported directory into its own storage
(RunConfig.storage_path/<run name>/checkpoint_<time>) before report() returns: a second full copy of every
checkpoint, written while training stands still. Our checkpoints already live in the run directory on a filesystem
that the driver and every worker share (the loop refuses to start otherwise), and a resume reads them from there,
never from Ray's copy. So with a local or shared storage path the report carries the step only: no copy, no disk
for it (Ray's copies filled the disk of a test and, with a DeepSeek-MoE-16B-width checkpoint, a GPU machine's
disk), no stall for it (benchmarks/checkpoint_stall.py). A cloud storage path
(cluster.storage_path=s3://...) is the one case where Ray's copy is worth its cost: it is the off-node copy, so
there the directory is uploaded as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def ray_keeps_a_copy(storage_path: str | None) -> bool:
    """Whether reported checkpoints are uploaded to Ray's storage: only for a remote URI (s3://, gs://, ...)."""
    return bool(storage_path) and "://" in str(storage_path)


def report_checkpoint(metrics: dict[str, Any], path: Path | None, rank: int, upload: bool) -> None:
    """ray.train.report for one finished save; every rank calls it at the same point (Ray expects the same number
    of reports from each). upload=True: rank 0 hands Ray the directory to copy (ray_keeps_a_copy); otherwise the
    metrics alone, with the checkpoint's path among them so the report still names it."""
    import ray.train

    from orchestration.checkpoint.directory import ray_checkpoint_dir

    exists = path is not None and Path(path).is_dir()
    checkpoint = None
    if upload and exists and rank == 0:
        checkpoint = ray.train.Checkpoint.from_directory(ray_checkpoint_dir(path))
    if exists:
        metrics = {**metrics, "checkpoint_path": str(path)}
    ray.train.report(metrics, checkpoint=checkpoint)
