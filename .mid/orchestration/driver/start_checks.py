"""Where a run lives, and what a start must pass before anything in its run directory changes: the run_root and
data source are usable, checkpoint.resume agrees with what the directory holds, the checkpoints are not all damaged,
a resume keeps the settings its checkpoints depend on (RESUME_KEYS), and the disk can hold a checkpoint. Shared by
the Ray driver (ray_job.py) and the torchrun launcher (torchrun.py), through ray_job.open_run_dir."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from orchestration.config import REPO_ROOT, JobConfig, to_dict

log = logging.getLogger(__name__)


def resolve_run_root(job: JobConfig) -> Path:
    """Where run directories live. Cloud URIs are for Ray's own storage; our run dir stays on a local/NFS path."""
    if job.run_root:
        return Path(job.run_root)
    if job.cluster.storage_path and "://" not in job.cluster.storage_path:
        return Path(job.cluster.storage_path)
    return REPO_ROOT / "runs"


# What a resumed run must share with the run that saved its checkpoints: the model's tensors, what runs in FP8, and
# the sample each data index maps to. Everything else (steps, lr, world size, monitors, cluster) may change.
RESUME_KEYS = ("model.name", "model.overrides", "precision.name", "precision.recipe", "precision.fp8_output_head",
               "precision.fp8_experts", "data.source", "data.glob", "data.max_files",
               "data.seq_len", "data.seed", "data.name", "data.manifest_sha256")


_ABSENT = object()


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def check_start(job: JobConfig, run_name: str) -> None:
    """Refuse, before anything in the run directory changes, a start that cannot work: a run_root that is a file,
    a data source the workers could not read, checkpoint.resume=false over a run that has checkpoints, a run whose
    checkpoints are all damaged, or a resume whose settings differ in RESUME_KEYS from the saved run's (the workers
    would fail on every Ray retry, after this driver had rewritten config.yaml). The saved settings are those the
    newest checkpoint was written with (its extra state holds the job config), else config.yaml. A resume that
    gives no train.lr takes the saved run's lr here (keep_saved_lr), before config.yaml is rewritten."""
    from orchestration.config import ConfigError

    root = resolve_run_root(job)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"run_root: {root} is a file, not a directory; point run_root at a directory")
    check_data_source(job)
    run_path = root / run_name
    checkpoints = run_path / "checkpoints"
    listing = list_checkpoints(checkpoints)
    if not listing:
        return  # nothing to resume: a fresh start (an empty or aborted run directory is reused)
    usable = [(name, path) for name, path, reason in listing if reason is None]
    if not job.checkpoint.resume:
        # Starting over is refused while one checkpoint is sound; here the digests decide (the workers refused
        # a resume of checkpoints with intact sizes and wrong digests, and named this way forward).
        sound = next((name for name, path in usable if checkpoint_sound(path)), None)
        if sound is None:
            log.warning("checkpoint.resume=false: run '%s' starts over in %s; its %d damaged checkpoints stay as they "
                        "are, never read and never counted by retention", run_name, run_path, len(listing))
            return
        raise ConfigError(f"checkpoint.resume=false but run '{run_name}' already has checkpoints ({sound} "
                          f"the newest, in {checkpoints}): starting over would mix two runs in one directory; "
                          "choose a new run_name, or drop checkpoint.resume=false to resume it (nothing was changed "
                          "on disk)")
    # The checkpoint the workers will load is verified with its digests here too, newest first until one is sound:
    # a resume the workers refused came after this driver had rewritten config.yaml and the run's events, and its
    # summary.json (step 0, failed) replaced the completed run's. The cost: one more read of that checkpoint.
    damaged = {name: reason for name, _, reason in listing if reason is not None}
    for name, path in usable:
        reason = checkpoint_damage(path)
        if reason is None:
            break
        damaged[name] = reason
    else:
        damage = "; ".join(f"{name}: {damaged[name]}" for name, _, _ in listing)
        raise ConfigError(f"run '{run_name}' cannot resume: every checkpoint in {checkpoints} is damaged ({damage}). "
                          f"Start the run over in its directory with checkpoint.resume=false, or choose a new "
                          "run_name (nothing was changed on disk)")
    usable = [(name, path) for name, path in usable if name not in damaged]
    saved_config = saved_job_config(run_name, run_path, usable[0][1])
    if saved_config is None:
        return  # a checkpoint from before the job config was saved in it, and no config.yaml: nothing to compare
    keep_saved_lr(job, saved_config)
    new_config = to_dict(job)
    # A key the saved config lacks (a run from before the setting existed) ran with the setting's default.
    defaults = to_dict(JobConfig())
    changed = []
    for key in RESUME_KEYS:
        saved_value = _lookup(saved_config, key)
        if saved_value is _ABSENT:
            saved_value = _lookup(defaults, key)
        if saved_value != _lookup(new_config, key):
            changed.append(f"{key} (saved {saved_value!r}, now {_lookup(new_config, key)!r})")
    if changed:
        raise ConfigError(f"run '{run_name}' has checkpoints ({usable[0][0]} the newest) made with other settings: "
                          f"{'; '.join(changed)}. Resuming needs the saved ones: restore them, or choose a new "
                          "run_name (nothing was changed on disk)")


def check_data_source(job: JobConfig) -> None:
    """Build the workers' datasets here once (cheap for the default corpus): a source without files or a corpus
    that cannot be read fails now, with the message the workers would have given, not after Ray started and
    retried the worker group four times."""
    from orchestration.config import ConfigError
    from orchestration.data.select import build_datasets

    try:
        build_datasets(job)
    except (OSError, ValueError) as exc:
        key = f"data.path={job.data.path!r}" if job.data.name == "tokenized" else f"data.source={job.data.source!r}"
        raise ConfigError(f"{key}: {exc}") from None


def list_checkpoints(checkpoints: Path) -> list[tuple[str, Path, str | None]]:
    """(name, path, what is wrong or None) of each finalized checkpoint, newest first. Checked without digests
    (manifest, files present with their recorded sizes, readable); check_start hashes only the one to resume from."""
    if not checkpoints.is_dir():
        return []
    from orchestration.checkpoint.directory import CheckpointError, verify_checkpoint
    from orchestration.checkpoint.manager import CheckpointManager

    listing = []
    manager = CheckpointManager(checkpoints, rank=0, world_size=1, create=False, clean_tmp=False)
    for _, path in manager.finalized():
        try:
            verify_checkpoint(path, checksums=False)
            listing.append((path.name, path, None))
        except CheckpointError as exc:
            listing.append((path.name, path, str(exc)))
    return listing


def checkpoint_sound(path: Path) -> bool:
    """Whether a checkpoint verifies with its digests (reads it whole)."""
    return checkpoint_damage(path) is None


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with a checkpoint, its digests checked (reads it whole); None when it is sound."""
    from orchestration.checkpoint.directory import CheckpointError, verify_checkpoint

    try:
        verify_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def saved_job_config(run_name: str, run_path: Path, checkpoint: Path) -> dict | None:
    """The job config the run's newest checkpoint was saved with (its extra state), else the run's config.yaml,
    else None. config.yaml alone is not enough: it is rewritten at every start, and may be gone."""
    import yaml

    from orchestration.checkpoint.directory import EXTRA_STATE
    from orchestration.config import ConfigError
    from orchestration.observability.events import CONFIG_FILE

    try:
        saved = json.loads((checkpoint / EXTRA_STATE).read_text()).get("job_config")
    except (OSError, ValueError):
        saved = None  # the workers' verification reports a damaged file; config.yaml may still tell
    if isinstance(saved, dict):
        return saved
    config_file = run_path / CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        return yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"run '{run_name}': cannot read its saved {config_file}: {exc}; restore the file or "
                          "choose a new run_name (nothing was changed on disk)") from None


def checkpoint_bytes(job: JobConfig) -> int:
    """Bytes of one checkpoint of this job: fp32 weights and AdamW's two fp32 moments, 12 bytes a parameter, plus 6%
    for DCP's metadata and the RNG states (debug_dense: 5.22 MB of tensors, 5.54 MB on disk)."""
    from models.planning import plan_model
    from models.registry import resolve_flavor

    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    params = plan_model(flavor, world_size=1, seq_len=job.data.seq_len, micro_batch=1).total_params
    return int(12 * params * 1.06)


def check_disk_space(job: JobConfig, run_path: Path, checkpoint_bytes: int) -> None:
    """Before anything starts: refuse when run_root's filesystem cannot hold the next checkpoint even with nothing
    else written (a save needs room for a whole new checkpoint before retention deletes an old one), warn when it
    cannot hold what retention keeps (keep_last checkpoints) plus the one being written."""
    import shutil

    from orchestration.config import ConfigError

    if not job.checkpoint.every_steps:
        return  # checkpoints off: nothing large is written
    probe = run_path if run_path.exists() else resolve_run_root(job)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    held = sum(p.stat().st_size for p in (run_path / "checkpoints").rglob("*") if p.is_file()) \
        if (run_path / "checkpoints").is_dir() else 0
    wanted = (job.checkpoint.keep_last + 1) * checkpoint_bytes
    where = resolve_run_root(job)
    if free < checkpoint_bytes:
        raise ConfigError(f"run_root: {_gb(free)} free on {where}, and one checkpoint needs {_gb(checkpoint_bytes)} "
                          f"({job.model.name}: fp32 weights and two AdamW moments): free space or point run_root "
                          "elsewhere")
    if free + held < wanted:
        log.warning(f"{_gb(free)} free on {where}; each checkpoint needs {_gb(checkpoint_bytes)} and the run holds "
                    f"up to {job.checkpoint.keep_last + 1} of them (checkpoint.keep_last={job.checkpoint.keep_last} + "
                    "the one being written): a save will run out of space unless space is freed")


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n < 1e11 else f"{n / 1e9:.0f} GB"


def keep_saved_lr(job: JobConfig, saved_config: dict) -> None:
    """A resume that sets no train.lr continues with the saved run's, not with today's model default: the run may
    have started with another lr (given then, or before train.lr=null existed), and the worker re-applies
    job.train.lr to every param group, so a changed default would cut the lr in the middle of the schedule. An lr
    given now wins (lowering the lr of a struggling run is a legitimate resume)."""
    saved_lr = _lookup(saved_config, "train.lr")
    if job.train.lr_source == "model" and isinstance(saved_lr, (int, float)) and saved_lr != job.train.lr:
        log.warning("Resuming with the run's saved train.lr=%r (the model's default is %r; pass train.lr=... to "
                    "change it)", saved_lr, job.train.lr)
        job.train.lr = float(saved_lr)
        job.train.lr_source = "config"
