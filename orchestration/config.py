"""Typed job configuration: one dataclass per Hydra group, validated once before Ray starts.

Hydra composes conf/ into a DictConfig; `load_job_config` merges it onto the structured schema below, so an unknown
key or a wrong type fails with the key's full name, and `validate` then checks the values that types cannot express
(ranges, divisibility, known names). Every user error is a ConfigError naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestration.faults import FaultConfig
from orchestration.monitor import MonitorConfig

REPO_ROOT = Path(__file__).resolve().parent.parent

PRECISIONS = ("bf16", "fp8")
RECIPES = ("auto", "tensorwise", "rowwise", "rowwise_gw_hp")
DEVICES = ("cpu", "cuda", "rocm", "auto")
DTYPES = ("float32", "bfloat16")
ENV_PRESET_NAMES = ("none", "nccl_h100", "nccl_h200", "rccl_mi300x", "rccl_mi350x")


MOE_WGRADS = ("hp", "global", "per_expert")  # fp8.grouped.WGRAD_SCALINGS, without importing torch here
MOE_DGRADS = ("auto", "fp8_reuse", "fp8_keep", "fp8_fast", "fp8", "hp", "width")  # fp8.grouped.DGRAD_CHOICES, likewise
TENSORWISE_TRANSPOSES = ("backward", "forward")  # fp8.linear.TENSORWISE_TRANSPOSES, likewise
# torch.compile modes for the blocks; "reduce-overhead" = CUDA graphs (see ModelConfig.compile_mode).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the key and what is allowed."""


@dataclass
class ModelConfig:
    name: str = "debug_moe"
    # Flavor fields to change, e.g. {n_layers: 2} for a reduced-depth benchmark; unknown keys fail at build time.
    overrides: dict[str, Any] = field(default_factory=dict)
    activation_checkpointing: bool = False
    # torch.compile every transformer block (it fuses the FP8 casts): None = on CUDA/ROCm devices, off on CPU.
    compile: bool | None = None
    # torch.compile mode of the blocks. "reduce-overhead" replays each block as a CUDA graph: it removes the host
    # launch gaps of the FP8 MoE block (whose grouped GEMM ops run eager bodies: one H200 step of the
    # DeepSeek-MoE-16B benchmark went from 136.9 to 124.3 ms, BENCHMARKS.md). One worker only: CUDA graphs of
    # FSDP2-sharded blocks (collectives in their hooks) are not supported here.
    compile_mode: str = "default"


@dataclass
class PrecisionConfig:
    name: str = "fp8"  # bf16 | fp8
    # auto = the recommended recipe for the device (fp8.recommended_recipe); ignored for bf16.
    recipe: str = "auto"
    # MoE expert weight-gradient GEMM: hp (bf16 grouped GEMM: faster than the fp8 one on H200 at
    # DeepSeek-MoE shapes, see BENCHMARKS.md), global or per_expert (fp8 with those column scales).
    moe_wgrad: str = "hp"
    # MoE expert grad-input GEMM (fp8.grouped.DGRAD_CHOICES): auto = fp8 on the forward's quantized weights with
    # power-of-two scales (fp8_reuse: the fastest measured, BENCHMARKS.md session 17), else fp8 with fast
    # accumulation; fp8_fast / fp8 (promoted accumulation) / hp (bf16) / width / fp8_reuse to choose one; fp8_keep
    # (fp8_reuse's operand written by the forward's weight cast and kept: +1 byte per expert parameter until backward).
    moe_dgrad: str = "auto"
    # Rows per expert group the MoE routing pads to in fp8 (fp8.grouped.check_token_group_align): 16 is what an fp8
    # weight gradient (moe_wgrad global/per_expert) needs; with moe_wgrad=hp, 1 (no padding) is allowed and opt-in
    # until checked and timed on a GPU.
    moe_token_group_align: int = 16
    # Linears whose K * N / (K + N) is below this stay in bf16 (fp8.convert.gemm_width: FP8's GEMM gain grows with
    # M * K * N, the cost of its casts with M * (K + N)). 0 converts every eligible linear. See README for the
    # widths measured to break even on the H200.
    fp8_min_gemm_width: float = 0.0
    # Convert the LM output head to FP8 too (fp8.convert.make_module_filter). Off: the head stays bf16, as in
    # torchtitan; on: the largest GEMM of a dense step runs in FP8 (see BENCHMARKS.md for its speed and loss).
    fp8_output_head: bool = False
    # With an FP8 head under the tensorwise recipe: compute the loss inside the head, whose backward writes the logits'
    # gradient once, in fp8 and in both layouts its GEMMs read (fp8/head.py), instead of a bf16 gradient cast again.
    # false: the unfused head and loss (the same function; for A/B runs).
    fp8_head_fused_loss: bool = True
    # Tensorwise recipe: where the fp8 transposed copies the backward GEMMs read are written (fp8.linear.
    # TENSORWISE_TRANSPOSES): backward (from the saved fp8 copies, by the transpose kernel) or forward (by the casts'
    # own compiled kernels, saved instead of the row-major copies: the same memory). The same function either way;
    # forward is opt-in until timed on a GPU (benchmarks/train_step.py +tfwd). The FP8 head with the loss fused into it
    # (fp8_head_fused_loss) runs its own kernels, eagerly: it writes its gradient in both layouts itself and keeps
    # transposing x and w in backward whatever this says.
    fp8_tensorwise_transposes: str = "backward"
    # Run the MoE routed experts' grouped GEMMs in FP8 (torch._scaled_grouped_mm). false keeps them bf16 while the
    # rest runs FP8: for GPUs or torch builds without an FP8 grouped GEMM (the worker refuses to emulate it there).
    fp8_experts: bool = True
    # Dtype of the matmul inputs outside the fp8 layers (autocast); float32 keeps CPU tests exact.
    compute_dtype: str = "bfloat16"
    # FSDP2 MixedPrecisionPolicy: parameters gathered in this dtype, gradients reduced in reduce_dtype.
    fsdp_param_dtype: str = "float32"
    fsdp_reduce_dtype: str = "float32"


@dataclass
class ClusterConfig:
    name: str = "local"
    address: str | None = None  # None: embedded local cluster; "auto" or "ray://host:10001" joins one
    min_workers: int = 2
    max_workers: int = 2
    device: str = "cpu"  # cpu | cuda | rocm | auto
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    memory_per_worker_gb: float = 8.0  # accelerator (or host) memory per worker, for the dry-run fits check
    storage_path: str | None = None  # None: <repo>/runs; else an absolute path or s3:// gs:// abfss:// URI
    env_preset: str = "none"
    env_vars: dict[str, str] = field(default_factory=dict)
    runtime_env: dict[str, Any] = field(default_factory=dict)
    max_failures: int = 3
    worker_group_start_timeout_s: float = 60.0
    health_check_interval_s: float = 0.2
    # How often a healthy elastic group checks whether more workers could run (Ray's default is 60 s). A grow
    # restarts the group from the latest checkpoint, so checking much more often than checkpoints are written
    # buys nothing.
    elastic_resize_interval_s: float = 60.0


@dataclass
class DataConfig:
    # "python_stdlib": the bytes of this interpreter's standard library sources (present on every machine);
    # otherwise an absolute path to a directory or a file of text.
    source: str = "python_stdlib"
    seq_len: int = 128
    seed: int = 1234
    # Files whose name matches this glob are read from a directory source.
    glob: str = "*.py"
    max_files: int = 400


@dataclass
class TrainConfig:
    steps: int = 120
    global_batch_size: int = 16  # sequences per optimizer step, constant across world sizes
    micro_batch_size: int = 4  # sequences per worker per forward; grad accumulation fills the rest
    lr: float | None = None  # None (null): the model flavor's peak_lr (published where known; models/registry.py)
    # Set when the config is loaded, not by users: "model" when lr was null and took the flavor's peak_lr (a resume
    # then keeps the saved run's lr, orchestration.trainer.check_start), "config" when lr was given.
    lr_source: str = "config"
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    log_every: int = 5
    seed: int = 0
    # FSDP2 sharding when world_size > 1 ("fsdp") or plain DDP-style gradient all-reduce ("none").
    sharding: str = "fsdp"
    # Python GC on a schedule (orchestration/gc_policy.py): automatic collection off while training, a young-
    # generation collection every N steps on all ranks at once; 0 = Python's automatic GC.
    gc_every_steps: int = 50
    # The AdamW step: "triton" = optim.ChunkedAdamW (one Triton launch per step over every parameter, the gradient clip
    # folded in: 2.6x torch's fused AdamW + clip pass for bf16 weights and 1.56x for fp32 on the H200, BENCHMARKS.md
    # session 15), "torch" = torch.optim.AdamW (fused on GPUs), "auto" = triton on NVIDIA GPUs, torch elsewhere
    # (ROCm: unverified, so torch). Same state dict either way: a checkpoint resumes under the other.
    adamw: str = "auto"


@dataclass
class CheckpointConfig:
    every_steps: int = 40
    keep_last: int = 3
    keep_good: int = 2
    # true: a start with an existing run's name resumes it (same RESUME_KEYS settings, orchestration/trainer.py).
    # false: refuse to start over a run that has checkpoints. Restarts within one start always resume.
    resume: bool = True
    report_to_ray: bool = True
    # Periodic saves in the background: copy the state to pinned host memory (~1 s for 27 GB on the H200 host), then
    # write, hash and finalize in a thread while training goes on (a synchronous save of that state took 25 s,
    # BENCHMARKS.md session 13). Costs host RAM equal to the rank's checkpoint shard, kept between saves.
    # auto = always with cluster.device=cuda, else never; always; never. The step-0, post-rollback and final saves are always synchronous.
    async_save: str = "auto"


@dataclass
class LoggingConfig:
    wandb: bool = True
    # auto: online when WANDB_API_KEY is set, else offline; WANDB_MODE in the environment overrides it.
    wandb_mode: str = "auto"
    project: str = "elastic-fp8"
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    progress_every_s: float = 5.0
    ray_metrics: bool = True


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    run_name: str | None = None
    run_root: str | None = None
    dry_run: bool = False


def load_job_config(cfg: DictConfig | dict) -> JobConfig:
    """Merge a composed config onto the schema (unknown keys and wrong types fail) and validate values."""
    schema = OmegaConf.structured(JobConfig)
    try:
        merged = OmegaConf.merge(schema, cfg)
        job = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"invalid config at '{key}': {exc.msg if hasattr(exc, 'msg') else exc}. "
                          f"See `python launch.py --help` for the groups and their options.") from None
    assert isinstance(job, JobConfig)
    validate(job)
    return job


def resolve_defaults(job: JobConfig) -> None:
    """Settings whose default depends on others: train.lr=null takes the model flavor's peak_lr (by flavor name;
    model.overrides do not change it). Resolved when the config is loaded (validate calls this), so config.yaml,
    W&B and the workers all see the number. Idempotent."""
    from models.registry import MODEL_FLAVORS

    if job.train.lr is None and job.model.name in MODEL_FLAVORS:  # an unknown model fails in validate
        job.train.lr = MODEL_FLAVORS[job.model.name].peak_lr
        job.train.lr_source = "model"


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def validate(job: JobConfig) -> None:
    """Value checks that types cannot express (after resolving train.lr=null, see resolve_defaults). Raises
    ConfigError naming the key and what is allowed."""
    from models.registry import MODEL_FLAVORS

    resolve_defaults(job)

    _require(job.model.name in MODEL_FLAVORS, "model.name",
             f"unknown model '{job.model.name}'; known: {', '.join(sorted(MODEL_FLAVORS))}")
    _require(job.model.compile_mode in COMPILE_MODES, "model.compile_mode",
             f"'{job.model.compile_mode}' is not one of {COMPILE_MODES}")
    _require(job.model.compile_mode != "reduce-overhead" or job.cluster.max_workers == 1, "model.compile_mode",
             "reduce-overhead (CUDA graphs) runs on one worker only (FSDP2's collectives cannot be captured in "
             f"the block graphs); got cluster.max_workers={job.cluster.max_workers}: set cluster.max_workers=1 or "
             "model.compile_mode=default")
    _require(job.precision.name in PRECISIONS, "precision.name",
             f"'{job.precision.name}' is not one of {PRECISIONS}")
    _require(job.precision.recipe in RECIPES, "precision.recipe",
             f"'{job.precision.recipe}' is not one of {RECIPES}")
    _require(job.precision.fp8_min_gemm_width >= 0, "precision.fp8_min_gemm_width",
             f"must be >= 0 (0 converts every eligible linear), got {job.precision.fp8_min_gemm_width}")
    _require(not (job.precision.fp8_output_head and job.precision.name != "fp8"), "precision.fp8_output_head",
             f"true needs precision=fp8 (got precision={job.precision.name}, which converts nothing): drop "
             "precision.fp8_output_head or use precision=fp8")
    _require(job.precision.moe_wgrad in MOE_WGRADS, "precision.moe_wgrad",
             f"'{job.precision.moe_wgrad}' is not one of {MOE_WGRADS}")
    _require(job.precision.moe_dgrad in MOE_DGRADS, "precision.moe_dgrad",
             f"'{job.precision.moe_dgrad}' is not one of {MOE_DGRADS}")
    _require(job.precision.fp8_tensorwise_transposes in TENSORWISE_TRANSPOSES, "precision.fp8_tensorwise_transposes",
             f"'{job.precision.fp8_tensorwise_transposes}' is not one of {TENSORWISE_TRANSPOSES}")
    from fp8.grouped import check_token_group_align  # the op's own rule (torch is loaded above by models.registry)

    try:
        check_token_group_align(job.precision.moe_token_group_align,
                                "hp" if job.precision.recipe == "rowwise_gw_hp" else job.precision.moe_wgrad)
    except ValueError as exc:
        _require(False, "precision.moe_token_group_align", f"{exc} (1 needs precision.moe_wgrad=hp)")
    for key in ("compute_dtype", "fsdp_param_dtype", "fsdp_reduce_dtype"):
        value = getattr(job.precision, key)
        _require(value in DTYPES, f"precision.{key}", f"'{value}' is not one of {DTYPES}")

    c = job.cluster
    _require(c.min_workers >= 1, "cluster.min_workers", f"must be >= 1, got {c.min_workers}")
    _require(c.max_workers >= c.min_workers, "cluster.max_workers",
             f"must be >= cluster.min_workers ({c.min_workers}), got {c.max_workers}")
    _require(c.device in DEVICES, "cluster.device", f"'{c.device}' is not one of {DEVICES}")
    _require(c.cpus_per_worker > 0, "cluster.cpus_per_worker", f"must be > 0, got {c.cpus_per_worker}")
    _require(c.gpus_per_worker >= 0, "cluster.gpus_per_worker", f"must be >= 0, got {c.gpus_per_worker}")
    _require(c.device in ("cpu", "auto") or c.gpus_per_worker > 0, "cluster.gpus_per_worker",
             f"must be > 0 when cluster.device={c.device}")
    _require(c.memory_per_worker_gb > 0, "cluster.memory_per_worker_gb", "must be > 0")
    _require(c.env_preset in ENV_PRESET_NAMES, "cluster.env_preset",
             f"'{c.env_preset}' is not one of {ENV_PRESET_NAMES}")
    if c.device in ("cuda", "rocm"):  # device=auto is checked by the worker once it knows its GPU's vendor
        from orchestration.env_presets import check_preset_device

        try:
            check_preset_device(c.env_preset, c.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _require(c.max_failures >= 0, "cluster.max_failures", "must be >= 0 (-1 is not supported: bound restarts)")
    _require(c.worker_group_start_timeout_s > 0, "cluster.worker_group_start_timeout_s", "must be > 0")
    _require(c.health_check_interval_s > 0, "cluster.health_check_interval_s", "must be > 0")
    _require(c.elastic_resize_interval_s >= 0, "cluster.elastic_resize_interval_s", "must be >= 0")
    if c.storage_path is not None and "://" not in c.storage_path:
        _require(os.path.isabs(c.storage_path), "cluster.storage_path",
                 f"must be absolute (Ray workers run in another cwd), got '{c.storage_path}'")

    d = job.data
    _require(d.seq_len >= 8, "data.seq_len", f"must be >= 8, got {d.seq_len}")
    if d.source != "python_stdlib":
        _require(os.path.isabs(d.source) and os.path.exists(d.source), "data.source",
                 f"'{d.source}' must be 'python_stdlib' or an absolute path to an existing file or directory")
    _require(d.max_files >= 1, "data.max_files", "must be >= 1")

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
    _require(t.sharding in ("fsdp", "none"), "train.sharding", f"'{t.sharding}' is not one of ('fsdp', 'none')")
    _require(t.adamw in ("auto", "triton", "torch"), "train.adamw",
             f"'{t.adamw}' is not one of ('auto', 'triton', 'torch')")
    _require(t.gc_every_steps >= 0, "train.gc_every_steps",
             f"must be >= 0 (0 = Python's automatic garbage collection), got {t.gc_every_steps}")
    _require(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    _require(t.global_batch_size >= 1, "train.global_batch_size", "must be >= 1")
    # Every world size of the elastic range must get at least one sequence per worker.
    _require(t.global_batch_size >= c.max_workers, "train.global_batch_size",
             f"{t.global_batch_size} sequences is fewer than cluster.max_workers={c.max_workers}: every worker "
             f"needs at least one sequence per step; raise it to >= {c.max_workers}")

    k = job.checkpoint
    _require(k.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
    _require(k.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _require(k.async_save in ("auto", "always", "never"), "checkpoint.async_save",
             f"'{k.async_save}' is not one of ('auto', 'always', 'never')")
    _require(k.keep_good >= 1, "checkpoint.keep_good", "must be >= 1")

    lg = job.logging
    _require(lg.wandb_mode in ("auto", "offline", "online", "disabled"), "logging.wandb_mode",
             f"'{lg.wandb_mode}' is not one of ('auto', 'offline', 'online', 'disabled')")
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


def to_dict(job: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(job)


def from_dict(data: dict[str, Any]) -> JobConfig:
    """Rebuild a JobConfig inside a worker from the plain dict the driver sent (already validated there)."""
    job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), data))
    assert isinstance(job, JobConfig)
    resolve_defaults(job)  # a hand-built dict may leave train.lr null
    return job


SECRET_MARKERS = ("key", "token", "password", "secret")


def is_secret_key(key: Any) -> bool:
    """The one rule for what counts as a credential (config.yaml masks it, W&B drops it)."""
    k = str(key).lower()
    return any(marker in k for marker in SECRET_MARKERS)


def redact_secrets(data: Any) -> Any:
    """Mask values whose key looks like a credential, recursively (config.yaml must never hold them)."""
    if isinstance(data, dict):
        return {k: ("<redacted>" if is_secret_key(k) else redact_secrets(v))
                for k, v in data.items()}
    if isinstance(data, list):
        return [redact_secrets(v) for v in data]
    return data
