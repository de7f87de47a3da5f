"""Loading and checking a job config: merge a composed Hydra config onto the schema of orchestration/config.py,
resolve the defaults that depend on other settings, and check what types cannot express (ranges, divisibility, known
names). Every user error is a ConfigError naming the key and what is allowed.

Separate from config.py because the checks need the model registry and the FP8 ops' own rules (models/, fp8/),
and config.py stays a leaf that the whole package can import.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestration.config import (
    COMPILE_MODES,
    DTYPES,
    ENV_PRESET_NAMES,
    PRESET_DEVICE,
    ConfigError,
    JobConfig,
)
from orchestration.machine_defaults import NO_GPU, Machine, resolve_machine_defaults


def load_job_config(cfg: DictConfig | dict) -> JobConfig:
    """Merge a composed config onto the schema (unknown keys and wrong types fail), decide the machine-dependent
    defaults for a machine without GPUs, and validate values (resolve_job: for the machine the job runs on)."""
    return resolve_job(cfg, NO_GPU)[0]


def resolve_job(cfg: DictConfig | dict, machine: Machine, *,
                enforce_machine: bool = False) -> tuple[JobConfig, list[str]]:
    """load_job_config for `machine`: the settings left null follow it (orchestration/machine_defaults.py).
    enforce_machine (a launch, not a dry run, which may plan GPUs elsewhere): on the embedded cluster, a job that
    asks for GPUs this machine lacks is refused. Returns the job and the notes saying what was decided."""
    job = merge_job_config(cfg)
    from orchestration.interop.config_check import resolve_from_hf

    resolve_from_hf(job)  # model=from_hf names a preset before the machine's defaults read the model
    requested = (job.cluster.device, job.cluster.min_workers, job.cluster.max_workers, job.cluster.gpus_per_worker)
    notes = resolve_machine_defaults(job, machine)
    notes += fp8_where_it_pays(job)
    if enforce_machine and job.cluster.address is None and not os.environ.get("RAY_ADDRESS"):
        check_machine_has(job, machine, requested)
    validate(job)
    return job, notes


def fp8_where_it_pays(job: JobConfig) -> list[str]:
    """A GPU job asking for FP8 where no layer's GEMMs are large enough for FP8 to pay (fp8.size_rule) trains in
    bf16, which is then the faster of the two: said in the plan. CPU jobs emulate FP8 and keep it."""
    from models.registry import MODEL_FLAVORS
    from orchestration.machine_defaults import is_gpu_job
    from orchestration.training.model_setup import plan_fp8

    if job.precision.name != "fp8" or not is_gpu_job(job) or job.model.name not in MODEL_FLAVORS:
        return []
    try:
        layers = plan_fp8(job, on_gpu=True)
    except (ValueError, TypeError):  # a bad model override: validate names it
        return []
    if layers.eligible and not layers.converted:
        job.precision.name = "bf16"
        job.precision.fp8_output_head = False
        return [(f"precision bf16: no layer of {job.model.name} is large enough for FP8 to pay at "
                f"{job.train.micro_batch_size} x {job.data.seq_len} tokens a micro-batch (fp8.size_rule); a larger "
                "micro-batch or data.seq_len brings FP8 back")]
    return []


def check_machine_has(job: JobConfig, machine: Machine, requested: tuple) -> None:
    """The embedded cluster runs on this machine alone: refuse GPUs it does not have, naming the key."""
    c = job.cluster
    if c.device not in ("cuda", "rocm"):
        return
    device_key_set = requested[0] != "auto"
    if not machine.has_gpus:
        raise ConfigError(f"cluster.device: {c.device} asked for, but this machine has no GPU ({machine.source}) - "
                          "leave cluster.device unset (auto) for the CPU demo, join a GPU cluster with "
                          "cluster.address, or plan only with dry_run=true")
    if machine.gpu_vendor != c.device and device_key_set:
        raise ConfigError(f"cluster.device: {c.device} asked for, but this machine's GPUs are {machine.gpu_vendor} "
                          f"({machine.gpu_name}) - set cluster.device={machine.gpu_vendor} or leave it unset")
    need = c.max_workers * (c.gpus_per_worker or 0)
    if need > machine.gpu_count:
        key = "cluster.max_workers" if requested[2] is not None or requested[1] is None else "cluster.min_workers"
        raise ConfigError(f"{key}: {c.max_workers} workers x {c.gpus_per_worker:g} GPU need {need:g} GPUs, this "
                          f"machine has {machine.gpu_count} ({machine.gpu_name}) - set cluster.min_workers and "
                          f"cluster.max_workers to at most {int(machine.gpu_count // max(c.gpus_per_worker, 1))}, "
                          "or join a larger cluster with cluster.address")


def merge_job_config(cfg: DictConfig | dict) -> JobConfig:
    """The composed config on the typed schema: unknown keys and wrong types fail, naming the key."""
    schema = OmegaConf.structured(JobConfig)
    try:
        # As plain data: Hydra adds `+group.key=...` to its composed (schema-typed) config under open_dict, so
        # merging that config as it is would carry an unknown key through; merged as plain data it fails here.
        plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        merged = OmegaConf.merge(schema, plain)
        job = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        what = str(exc.msg if hasattr(exc, "msg") else exc).strip().splitlines()[0]  # without OmegaConf's key lines
        raise ConfigError(f"invalid config at '{key}': {what}. "
                          f"See `python launch.py --help` for the groups and their options.") from None
    assert isinstance(job, JobConfig)
    return job


def resolve_defaults(job: JobConfig) -> None:
    """Settings whose default depends on others: train.lr=null takes the model flavor's peak_lr (by flavor name;
    model.overrides do not change it). Resolved when the config is loaded (validate calls this), so config.yaml,
    W&B and the workers all see the number. precision.fsdp_param_dtype=auto takes precision.compute_dtype.
    Settings the machine decides and that are still null (a config built in code) take the CPU demo's values.
    Idempotent."""
    from models.registry import MODEL_FLAVORS
    from orchestration.interop.config_check import resolve_from_hf

    resolve_from_hf(job)  # model=from_hf: a preset with config.json's architecture, before anything reads the model
    resolve_machine_defaults(job, NO_GPU)
    if job.train.lr is None and job.model.name in MODEL_FLAVORS:  # an unknown model fails in validate
        job.train.lr = MODEL_FLAVORS[job.model.name].peak_lr
        job.train.lr_source = "model"
    job.precision.fsdp_param_dtype = job.precision.fsdp_gather_dtype()


def check_choices(job: JobConfig) -> None:
    """Every choice field (a StrEnum in orchestration/config.py) holds one of its values. A composed config is
    already held to them by OmegaConf; this covers a JobConfig built or changed in code, with the same message."""
    for group in dataclasses.fields(job):
        section = getattr(job, group.name)
        if not dataclasses.is_dataclass(section):
            continue
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            kind = hints.get(f.name)
            if isinstance(kind, type) and issubclass(kind, Enum):
                value = getattr(section, f.name)
                allowed = [member.value for member in kind]
                _require(value in allowed, f"{group.name}.{f.name}",
                         f"invalid value '{value}' - use one of {', '.join(map(repr, allowed))}")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def validate(job: JobConfig) -> None:
    """Value checks that types cannot express (after resolving train.lr=null, see resolve_defaults). Raises
    ConfigError naming the key and what is allowed."""
    from models.registry import MODEL_FLAVORS

    resolve_defaults(job)
    check_choices(job)

    _require(job.model.name in MODEL_FLAVORS, "model.name",
             f"unknown model '{job.model.name}'; known: {', '.join(sorted(MODEL_FLAVORS))}")
    _require(job.model.compile_mode in COMPILE_MODES, "model.compile_mode",
             f"'{job.model.compile_mode}' is not one of {COMPILE_MODES}")
    _require(job.model.compile_mode != "reduce-overhead" or job.cluster.max_workers == 1, "model.compile_mode",
             "reduce-overhead (CUDA graphs) runs on one worker only (FSDP2's collectives cannot be captured in "
             f"the block graphs); got cluster.max_workers={job.cluster.max_workers}: set cluster.max_workers=1 or "
             "model.compile_mode=default")
    _require(not (job.precision.fp8_output_head and job.precision.name != "fp8"), "precision.fp8_output_head",
             f"true needs precision=fp8 (got precision={job.precision.name}, which converts nothing): drop "
             "precision.fp8_output_head or use precision=fp8")
    _require(not (job.precision.fp8_all_gather and (job.precision.name != "fp8"
                                                     or job.precision.recipe not in ("auto", "tensorwise"))),
             "precision.fp8_all_gather",
             f"true needs precision=fp8 with the tensorwise recipe (got precision={job.precision.name}, recipe="
             f"{job.precision.recipe}; rowwise recipes scale each weight row for its own GEMM, so there is no one fp8 "
             "copy to gather): drop precision.fp8_all_gather or set precision.recipe=tensorwise")
    for key in ("compute_dtype", "fsdp_param_dtype", "fsdp_reduce_dtype"):
        value = getattr(job.precision, key)
        _require(value in DTYPES, f"precision.{key}", f"'{value}' is not one of {DTYPES}")

    c = job.cluster
    from models.scaling import FABRICS

    _require(c.fabric == "none" or c.fabric in FABRICS, "cluster.fabric",
             f"'{c.fabric}' is not one of {('none', *FABRICS)}")
    _require(c.min_workers >= 1, "cluster.min_workers", f"must be >= 1, got {c.min_workers}")
    _require(c.max_workers >= c.min_workers, "cluster.max_workers",
             f"must be >= cluster.min_workers ({c.min_workers}), got {c.max_workers}")
    _require(c.cpus_per_worker > 0, "cluster.cpus_per_worker", f"must be > 0, got {c.cpus_per_worker}")
    _require(c.gpus_per_worker >= 0, "cluster.gpus_per_worker", f"must be >= 0, got {c.gpus_per_worker}")
    _require(c.device in ("cpu", "auto") or c.gpus_per_worker > 0, "cluster.gpus_per_worker",
             f"must be > 0 when cluster.device={c.device}")
    _require(c.memory_per_worker_gb > 0, "cluster.memory_per_worker_gb", "must be > 0")
    _require(c.env_preset in ENV_PRESET_NAMES, "cluster.env_preset",
             f"'{c.env_preset}' is not one of {ENV_PRESET_NAMES}")
    if c.device in ("cuda", "rocm"):  # device=auto is checked by the worker once it knows its GPU's vendor
        try:
            check_preset_device(c.env_preset, c.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _require(c.max_failures >= 0, "cluster.max_failures", "must be >= 0 (-1 is not supported: bound restarts)")
    _require(c.worker_group_start_timeout_s > 0, "cluster.worker_group_start_timeout_s", "must be > 0")
    _require(c.health_check_interval_s > 0, "cluster.health_check_interval_s", "must be > 0")
    _require(c.elastic_resize_interval_s >= 0, "cluster.elastic_resize_interval_s", "must be >= 0")
    _require(c.drain_poll_interval_s > 0, "cluster.drain_poll_interval_s", "must be > 0")
    if c.storage_path is not None and "://" not in c.storage_path:
        _require(os.path.isabs(c.storage_path), "cluster.storage_path",
                 f"must be absolute (Ray workers run in another cwd), got '{c.storage_path}'")

    d = job.data
    _require(d.seq_len >= 8, "data.seq_len", f"must be >= 8, got {d.seq_len}")
    from models.registry import resolve_flavor

    try:
        rope_range = resolve_flavor(job.model.name, dict(job.model.overrides)).args.max_seq_len
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model.overrides: {exc}") from None
    _require(d.seq_len <= rope_range, "data.seq_len",
             f"{d.seq_len} is beyond {job.model.name}'s RoPE range (max_seq_len={rope_range}) - lower data.seq_len "
             f"to <= {rope_range}, or raise +model.overrides.max_seq_len")
    if d.source != "python_stdlib":
        _require(os.path.isabs(d.source) and os.path.exists(d.source), "data.source",
                 f"'{d.source}' must be 'python_stdlib' or an absolute path to an existing file or directory")
    _require(d.max_files >= 1, "data.max_files", "must be >= 1")
    from orchestration.data.select import resolve_data  # reads a prepared corpus's manifest; sizes the vocabulary

    resolve_data(job)
    from orchestration.interop.config_check import check_hf_settings

    check_hf_settings(job)  # after resolve_data: it may size a debug model's vocabulary

    t = job.train
    _require(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
    _require(t.lr is not None and t.lr > 0, "train.lr", f"must be > 0 (or null: the model's peak lr), got {t.lr}")
    _require(t.lr_source in ("config", "model"), "train.lr_source",
             f"'{t.lr_source}' is set when the config loads; leave it out")
    _require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
    _require(0 <= t.warmup_steps <= t.steps, "train.warmup_steps", f"must be in [0, train.steps={t.steps}]")
    _require(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1/beta2", "must be in [0, 1)")
    _require(t.grad_clip > 0, "train.grad_clip", "must be > 0")
    _require(t.log_every >= 1, "train.log_every", "must be >= 1")
    _require(t.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 = no evaluation), got {t.eval_every}")
    _require(t.gc_every_steps >= 0, "train.gc_every_steps",
             f"must be >= 0 (0 = Python's automatic garbage collection), got {t.gc_every_steps}")
    _require(0 <= t.profile_from_step < t.steps, "train.profile_from_step",
             f"must be in [0, train.steps={t.steps}) (0 = no profile), got {t.profile_from_step}")
    _require(t.profile_steps >= 1, "train.profile_steps", f"must be >= 1, got {t.profile_steps}")
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    _require(t.global_batch_size >= 1, "train.global_batch_size", "must be >= 1")
    # Every world size of the elastic range must get at least one sequence per worker.
    _require(t.global_batch_size >= c.max_workers, "train.global_batch_size",
             f"{t.global_batch_size} sequences is fewer than cluster.max_workers={c.max_workers}: every worker "
             f"needs at least one sequence per step; raise it to >= {c.max_workers}")

    check_parallel_layout(job)

    k = job.checkpoint
    _require(k.every_steps >= 0, "checkpoint.every_steps", "must be >= 0 (0 = no checkpoints)")
    _require(k.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _require(k.keep_good >= 1, "checkpoint.keep_good", "must be >= 1")

    lg = job.logging
    _require(lg.progress_every_s > 0, "logging.progress_every_s", "must be > 0")

    if job.run_root is not None:
        _require(os.path.isabs(job.run_root), "run_root", f"must be an absolute path, got '{job.run_root}'")
    if job.run_name is not None:
        _require(job.run_name and "/" not in job.run_name and job.run_name not in (".", ".."), "run_name",
                 f"'{job.run_name}' must be a plain directory name")

    validate_monitor = getattr(job.monitor, "validate", None)
    if callable(validate_monitor):
        try:
            validate_monitor()
        except ValueError as exc:
            raise ConfigError(f"monitor: {exc}") from None
    validate_faults = getattr(job.faults, "validate", None)
    if callable(validate_faults):
        try:
            validate_faults()
        except ValueError as exc:
            raise ConfigError(f"faults: {exc}") from None


def from_dict(data: dict[str, Any], gpu_vendor: str | None = None) -> JobConfig:
    """Rebuild a JobConfig inside a worker from the plain dict the driver sent (already validated there).

    gpu_vendor: the worker's GPU ("cuda" or "rocm"; None on CPU), checked against cluster.env_preset: the config
    check covered explicit devices, device=auto is known only in the worker."""
    job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), data))
    assert isinstance(job, JobConfig)
    resolve_defaults(job)  # a hand-built dict may leave train.lr null
    if gpu_vendor is not None:
        check_preset_device(job.cluster.env_preset, gpu_vendor)
    return job



def check_preset_device(preset: str, device: str) -> None:
    """ValueError when a vendor-specific preset meets the other vendor's device (cuda vs rocm)."""
    if preset not in PRESET_DEVICE:
        raise ValueError(f"cluster.env_preset: unknown preset '{preset}'; choose one of {sorted(PRESET_DEVICE)}")
    wanted = PRESET_DEVICE[preset]
    if wanted is not None and device in ("cuda", "rocm") and device != wanted:
        raise ValueError(f"cluster.env_preset={preset} is for {wanted} devices but cluster.device={device}; "
                         f"use a {device} preset ({[p for p, d in PRESET_DEVICE.items() if d == device]}) "
                         "or env_preset=none")


def check_parallel_layout(job: JobConfig) -> None:
    """train.sharding / shard_group_size / expert_parallel against the model. The world size is not checked: each
    (re)start lowers the degrees to what its world size allows (orchestration.training.elastic.plan_layout), and the
    plan lists the layout of every world size of the elastic range."""
    from models.registry import resolve_flavor

    t = job.train
    _require(t.expert_parallel >= 1, "train.expert_parallel", f"must be >= 1 (1 = off), got {t.expert_parallel}")
    if t.shard_group_size is not None:
        _require(t.shard_group_size >= 1, "train.shard_group_size", f"must be >= 1, got {t.shard_group_size}")
        _require(t.sharding == "hsdp", "train.shard_group_size",
                 f"is HSDP's shard group size but train.sharding={t.sharding}; set train.sharding=hsdp or leave "
                 "train.shard_group_size null")
    if t.expert_parallel == 1:
        _require(not t.expert_dispatch_fp8, "train.expert_dispatch_fp8",
                 "sends expert-parallel tokens in FP8 but train.expert_parallel=1; set train.expert_parallel > 1")
        return
    _require(t.sharding != "none", "train.expert_parallel",
             "needs train.sharding=fsdp or hsdp (the rest of the model is sharded around the experts); set one")
    experts = getattr(resolve_flavor(job.model.name, dict(job.model.overrides)).args, "n_routed_experts", 0)
    _require(experts > 0, "train.expert_parallel",
             f"model {job.model.name} has no routed experts; set train.expert_parallel=1")
    _require(experts % t.expert_parallel == 0, "train.expert_parallel",
             f"{t.expert_parallel} does not divide the {experts} routed experts of {job.model.name}; pick a divisor")
