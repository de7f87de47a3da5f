"""Typed job configuration: one dataclass per Hydra group, validated once before Ray starts.

Hydra composes conf/ into a DictConfig; `load_job_config` merges it onto the structured schema below, so an unknown
key or a wrong type fails with the key's full name, and `validate` then checks the values that types cannot express
(ranges, divisibility, known names). Every user error is a ConfigError naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


# Choice fields are StrEnums: OmegaConf refuses any other value naming the key and the allowed ones, and a member
# still equals, hashes and formats as its string ("fp8"), so code and saved configs compare it with plain strings.
class Precision(StrEnum):
    bf16 = "bf16"
    fp8 = "fp8"


class RecipeName(StrEnum):
    """precision.recipe: a name of fp8.recipes (fp8.Recipe is the recipe itself), or auto."""
    auto = "auto"
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_gw_hp = "rowwise_gw_hp"


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"
    rocm = "rocm"
    auto = "auto"


class Sharding(StrEnum):
    fsdp = "fsdp"
    none = "none"
    hsdp = "hsdp"


class AdamW(StrEnum):
    auto = "auto"
    triton = "triton"
    torch = "torch"


class AsyncSave(StrEnum):
    auto = "auto"
    always = "always"
    never = "never"


class WandbMode(StrEnum):
    auto = "auto"
    offline = "offline"
    online = "online"
    disabled = "disabled"


class FallbackScope(StrEnum):
    model = "model"
    layers = "layers"


class ExportHf(StrEnum):
    none = "none"
    final = "final"


class FaultKind(StrEnum):
    none = "none"
    nan_grad = "nan_grad"
    loss_spike = "loss_spike"
    fp8_overflow = "fp8_overflow"
    fp8_scale_error = "fp8_scale_error"
    kill_worker = "kill_worker"
    crash = "crash"


PRECISIONS = tuple(p.value for p in Precision)
RECIPES = tuple(r.value for r in RecipeName)
DEVICES = tuple(d.value for d in Device)
DTYPES = ("float32", "bfloat16")
ENV_PRESET_NAMES = ("none", "nccl_h100", "nccl_h200", "rccl_mi300x", "rccl_mi350x")
# Which torch build each preset is for (orchestration/driver/env_presets.py holds their variables); None fits every
# device.
PRESET_DEVICE: dict[str, str | None] = {
    "none": None,
    "nccl_h100": "cuda",
    "nccl_h200": "cuda",
    "rccl_mi300x": "rocm",
    "rccl_mi350x": "rocm",
}


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
    # launch gaps of the FP8 MoE block, whose grouped GEMM ops run eager bodies (BENCHMARKS.md, "Tried, did not pay":
    # why it is not the default). One worker only: CUDA graphs of FSDP2-sharded blocks (collectives in their hooks)
    # are not supported here.
    compile_mode: str = "default"
    # A Hugging Face checkpoint directory (config.json, model.safetensors or shards + model.safetensors.index.json) the
    # run's weights start from instead of a random init: Llama 3 (LlamaForCausalLM) or DeepSeek-MoE (the
    # deepseek-moe-16b layout), docs/interop.md. With a preset its config.json must describe the same architecture;
    # model=from_hf takes the architecture from config.json. Read once, at the run's first start: a resume loads its
    # checkpoint instead.
    init_from: str | None = None


@dataclass
class PrecisionConfig:
    name: Precision = Precision.fp8
    # auto = the recommended recipe for the device (fp8.recommended_recipe): tensorwise on NVIDIA (the fastest
    # measured, BENCHMARKS.md), rowwise_gw_hp on ROCm; ignored for bf16.
    recipe: RecipeName = RecipeName.auto
    # Convert the LM output head to FP8 too (fp8.convert.make_module_filter), its loss fused into it under the
    # tensorwise recipe (fp8/head.py). On in conf/precision/fp8.yaml (torchtitan leaves it off): it speeds up the
    # product loop of both model families and its held-out eval loss stays inside bf16's own seed-to-seed spread and
    # the quality gate (BENCHMARKS.md: the product loop and quality tables). False here: bf16 runs have no FP8 head.
    fp8_output_head: bool = False
    # Run the MoE routed experts' grouped GEMMs in FP8 (torch._scaled_grouped_mm). false keeps them bf16 while the
    # rest runs FP8: for GPUs or torch builds without an FP8 grouped GEMM (the worker refuses to emulate it there).
    fp8_experts: bool = True
    # Dtype of the matmul inputs outside the fp8 layers (autocast); float32 keeps CPU tests exact.
    compute_dtype: str = "bfloat16"
    # FSDP2 MixedPrecisionPolicy: parameters gathered in this dtype (the float32 master weights stay sharded), gradients
    # reduced in reduce_dtype. auto = compute_dtype: under bf16 autocast every matmul casts its weight to bf16 anyway,
    # so a float32 gather sends twice the bytes for the same operands (torchtitan gathers bf16); the two gathers train
    # to the same loss (docs/scaling.md).
    fsdp_param_dtype: str = "auto"
    fsdp_reduce_dtype: str = "float32"
    # FSDP2 all-gathers the tensorwise FP8 linears' weights in fp8 (fp8/fsdp_allgather.py): one byte per element, half
    # of a bf16 gather, a quarter of float32's; bit-equal to gathering them in high precision and casting after
    # (tests/test_fp8_fsdp_allgather.py). null = on with the tensorwise recipe when FSDP2 shards (world size > 1).
    fp8_all_gather: bool | None = None

    def fsdp_gather_dtype(self) -> str:
        """The dtype FSDP2 gathers parameters in: fsdp_param_dtype, auto resolved to compute_dtype. Read before
        validation resolves the field too (the machine defaults plan the micro-batch first)."""
        return self.compute_dtype if self.fsdp_param_dtype == "auto" else self.fsdp_param_dtype


@dataclass
class ClusterConfig:
    name: str = "local"
    address: str | None = None  # None: embedded local cluster; "auto" or "ray://host:10001" joins one
    # The four fields below left null are decided by the machine (orchestration/machine_defaults.py): on the embedded
    # cluster from the GPUs this machine has, on a joined cluster from Ray's node resources. GPUs -> one worker per
    # GPU with the device's memory; none -> the 2-worker CPU demo. A value set here always wins.
    min_workers: int | None = None
    max_workers: int | None = None
    # auto: cuda or rocm when the machine has GPUs of that vendor, else cpu.
    device: Device = Device.auto
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None  # null: 1 on cuda/rocm, 0 on cpu
    memory_per_worker_gb: float | None = None  # accelerator (or host) memory per worker, for the memory plan
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
    # How often Ray Train looks for a drain of one of the group's nodes (a preemption notice: docs/reliability.md);
    # the workers save at the first step after it sees one (Ray's own default polls less often).
    drain_poll_interval_s: float = 1.0
    # Interconnect preset of models.scaling.FABRICS (nvlink_ib400, nvlink_roce400, aws_efa, mi300x_roce400): dry_run=true
    # then predicts step time, tokens/s per GPU, MFU and scaling efficiency from 1 to 1,024 GPUs. "none": no prediction.
    fabric: str = "none"


DATA_KINDS = ("stdlib", "tokenized")


@dataclass
class DataConfig:
    # The conf/data group: "stdlib" reads raw bytes of text files on the fly (source, glob, max_files below);
    # "tokenized" reads a corpus prepared by `python -m orchestration.data.prepare` (path). docs/data.md.
    name: str = "stdlib"
    # "python_stdlib": the bytes of this interpreter's standard library sources (present on every machine);
    # otherwise an absolute path to a directory or a file of text.
    source: str = "python_stdlib"
    # Tokens per sequence. null: the model's published context length (its RoPE range, max_seq_len) on GPUs, 128 on
    # CPU (orchestration/machine_defaults.py).
    seq_len: int | None = None
    seed: int = 1234
    # Files whose name matches this glob are read from a directory source; the first max_files (sorted) are the
    # training data, the files after them the held-out data of train.eval_every.
    glob: str = "*.py"
    max_files: int = 400
    # data=tokenized: absolute path of the prepared directory (manifest.json and its token shards).
    path: str | None = None
    # "bytes" (data=stdlib), or for data=tokenized null (the manifest's tokenizer) or the tokenizer.json the corpus
    # was prepared with (checked against the manifest's sha256).
    tokenizer: str | None = "bytes"
    # Validation sequences of data.seq_len tokens per evaluation (train.eval_every): the same ones at any world size.
    eval_sequences: int = 32
    # Set when the config is loaded, not by users: the sha256 of the prepared corpus's manifest.json (names corpus,
    # tokenizer and split; a resume on another one is refused, orchestration.driver.start_checks.RESUME_KEYS).
    manifest_sha256: str | None = None


@dataclass
class TrainConfig:
    steps: int = 120
    # Sequences per optimizer step, constant across world sizes. null: on GPUs the model flavor's tokens per GPU
    # step (models/registry.py) times cluster.max_workers, in sequences of data.seq_len; on CPU 16.
    global_batch_size: int | None = None
    # Sequences per worker per forward; gradient accumulation fills the rest. null: on GPUs the largest that the
    # memory plan fits at cluster.min_workers; on CPU 4.
    micro_batch_size: int | None = None
    lr: float | None = None  # None (null): the model flavor's peak_lr (published where known; models/registry.py)
    # Set when the config is loaded, not by users: "model" when lr was null and took the flavor's peak_lr (a resume
    # then keeps the saved run's lr, orchestration.driver.start_checks.check_start), "config" when lr was given.
    lr_source: str = "config"
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    log_every: int = 5
    # Held-out evaluation every this many steps and at the last step (orchestration/training/evaluation.py):
    # data.eval_sequences validation sequences, logged as eval_loss. 0 = never.
    eval_every: int = 50
    seed: int = 0
    # FSDP2 sharding when world_size > 1 ("fsdp") or plain DDP-style gradient all-reduce ("none").
    sharding: Sharding = Sharding.fsdp
    # Python GC on a schedule (orchestration/training/gc_policy.py): automatic collection off while training, a young-
    # generation collection every N steps on all ranks at once; 0 = Python's automatic GC.
    gc_every_steps: int = 50
    # The AdamW step: "triton" = optim.ChunkedAdamW (one Triton launch per step over every parameter, the gradient clip
    # folded in; faster than torch's fused AdamW + clip pass, BENCHMARKS.md),
    # "torch" = torch.optim.AdamW (fused on GPUs), "auto" = triton on NVIDIA GPUs, torch elsewhere
    # (ROCm: unverified, so torch). Same state dict either way: a checkpoint resumes under the other.
    adamw: AdamW = AdamW.auto
    # torch.profiler over train.profile_steps loop iterations from step train.profile_from_step (0 = off): a Chrome
    # trace and where the time went (GEMMs, FP8 casts, attention, optimizer, idle) per rank in the run directory's
    # profile/, and a `profile` event (orchestration/training/profiling.py).
    profile_from_step: int = 0
    profile_steps: int = 3
    # sharding=hsdp: ranks per shard group (FSDP inside a group, replicas across groups); must divide the world size.
    # null: the workers per node (LOCAL_WORLD_SIZE, one per GPU), so the all-gathers stay on the node's links.
    shard_group_size: int | None = None
    # Expert parallelism for MoE models: each MoE layer's routed experts split over groups of this many ranks (E / N
    # each), tokens sent to their experts by all-to-all (orchestration/training/expert_parallel.py); the rest of the
    # model stays under FSDP/HSDP. Must divide the world size and the routed experts. 1 = off.
    expert_parallel: int = 1
    # With expert_parallel > 1: send the routed tokens to the experts in FP8 (e4m3 plus a float32 scale per row, the
    # cast the FP8 grouped GEMM applies anyway): about half the dispatch bytes of bf16.
    expert_dispatch_fp8: bool = False


@dataclass
class CheckpointConfig:
    # 0: no checkpoints at all (benchmark and quality runs; a 4-layer MoE-width save is ~30 GB): a restart starts
    # over and a divergence that needs a rollback stops the run instead.
    every_steps: int = 40
    keep_last: int = 3
    keep_good: int = 2
    # true: a start with an existing run's name resumes it (same RESUME_KEYS settings, driver/start_checks.py).
    # false: refuse to start over a run that has checkpoints. Restarts within one start always resume.
    resume: bool = True
    report_to_ray: bool = True
    # Periodic saves in the background: copy the state to pinned host memory, then write, hash and finalize in a
    # thread while training goes on (the stall per save, either way: BENCHMARKS.md "Checkpoint stall"). Costs host
    # RAM equal to the rank's checkpoint shard, kept between saves.
    # auto = always with cluster.device=cuda, else never; always; never. The step-0, post-rollback and final saves are always synchronous.
    async_save: AsyncSave = AsyncSave.auto
    # "final": when the run completes, write its last checkpoint as a Hugging Face directory (safetensors, config.json,
    # tokenizer files) in <run_dir>/hf/step_NNNNNN, as `python -m orchestration.export RUN_DIR --step latest` does.
    export_hf: ExportHf = ExportHf.none


@dataclass
class LoggingConfig:
    wandb: bool = True
    # auto: online when WANDB_API_KEY is set, else offline; WANDB_MODE in the environment overrides it.
    wandb_mode: WandbMode = WandbMode.auto
    project: str = "elastic-fp8"
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    progress_every_s: float = 5.0
    ray_metrics: bool = True


@dataclass
class MonitorConfig:
    """Thresholds and windows of the divergence monitors and of the policy (conf/monitor).

    Detector fields come first, policy fields (read by orchestration.divergence.policy.DivergencePolicy) after.
    All step counts are optimizer steps.
    """

    enabled: bool = True
    """Master switch: when False the worker loop should not build verdicts and the policy always proceeds."""

    # --- running baselines -------------------------------------------------------------------------------------
    warmup_steps: int = 20
    """Clean steps a baseline must have seen before spike / amax-growth detection is armed (non-finite, FP8
    saturation/underflow and shadow checks are armed from step 0)."""
    ema_beta: float = 0.98
    """Decay of the EMA mean/variance baselines (effective window about 1 / (1 - beta) = 50 steps)."""
    winsor_z: float = 3.0
    """After warm-up, a value feeding a baseline is clipped to mean +- winsor_z * std (robustness)."""

    # --- loss spike ----------------------------------------------------------------------------------------------
    loss_spike_z: float = 6.0
    """A step's (worst-rank) loss is a spike when loss > mean + loss_spike_z * std."""
    loss_std_floor_rel: float = 0.01
    """Floor of the loss std as a fraction of |mean| (a smooth loss must still rise by z * 1% to alarm)."""
    loss_std_floor_abs: float = 1e-3
    """Absolute floor of the loss std (loss near zero)."""

    # --- grad-norm spike (log space) -----------------------------------------------------------------------------
    grad_norm_spike_z: float = 8.0
    """A grad norm is a spike when log(norm) > mean_log + grad_norm_spike_z * std_log."""
    grad_norm_log_std_floor: float = 0.25
    """Floor of the std of log(grad norm): with z = 8 the norm must at least grow exp(2) = 7.4x to alarm. Small
    batches late in training see 3-5x grad-norm excursions that clipping already absorbs (measured on the debug
    models: 6.0 / 0.1 skipped 2 healthy steps in 800); a real blow-up is orders of magnitude."""

    # --- FP8 health (fp8.fp8_health: saturated_frac, underflow_frac, amax_max) ------------------------------------
    fp8_saturated_frac_max: float = 1e-3
    """Largest tolerated fraction of values clamped to the FP8 max in the last forward (any rank)."""
    fp8_underflow_frac_max: float = 0.1
    """Largest tolerated fraction of non-zero values flushed to zero by the FP8 cast."""
    fp8_amax_growth_max: float = 16.0
    """amax_max is an overflow risk when it exceeds fp8_amax_growth_max times its running (geometric) baseline."""

    # --- shadow check: recompute one micro-batch in BF16 ----------------------------------------------------------
    shadow_every: int = 0
    """Run the BF16 shadow check every N steps while FP8 is on (0 disables it)."""
    shadow_rel_tol: float = 0.05
    """Largest tolerated |loss_fp8 - loss_bf16| / |loss_bf16| on the shadow micro-batch."""

    # --- held-out eval gap: the same weights evaluated in FP8 and in BF16 at each evaluation (train.eval_every) ----
    eval_gap_max: float = 0.02
    """Largest tolerated (eval_loss_fp8 - eval_loss_bf16) / eval_loss_bf16 while FP8 is on; above it the policy falls
    back to BF16 as for the other FP8 detectors (cool-down, retry, relapses). 0 skips the BF16 evaluation."""

    # --- policy: skip ----------------------------------------------------------------------------------------------
    skips_before_escalation: int = 1
    """Bad steps inside `escalation_window` that are only skipped; the next one escalates (fallback or rollback)."""
    escalation_window: int = 50
    """Steps over which bad steps count as 'repeated'."""
    max_skips_per_window: int = 5
    """Skip budget: at most this many skipped steps in any `skip_window` steps, then escalate instead."""
    skip_window: int = 200
    """Window of the skip budget."""

    # --- policy: BF16 fallback -------------------------------------------------------------------------------------
    fallback_scope: FallbackScope = FallbackScope.model
    """'model': fall back to BF16 for the whole model; 'layers': only the offending FP8 layers when the evidence
    names them (a non-finite loss or a spike is never attributable, it falls back the whole model)."""
    cooldown_steps: int = 100
    """Steps in BF16 after a fallback before FP8 is retried."""
    relapse_window: int = 200
    """A fallback within this many steps after a retry of FP8 counts as a relapse."""
    max_relapses: int = 2
    """After this many relapses the run stays in BF16 for good (0: never retry FP8 after a fallback)."""

    # --- policy: rollback and stop ---------------------------------------------------------------------------------
    max_rollbacks: int = 3
    """Rollbacks allowed in a run; one more bad episode after them stops the run with status 'diverged'."""
    rollback_skip_samples: int = 0
    """Extra samples skipped after a rollback beyond the data up to the bad step (PaLM skipped 200-500 batches)."""
    rollback_lr_scale: float = 1.0
    """Multiplier applied to the LR at each rollback (cumulative; 1.0 keeps the LR)."""
    good_after_steps: int = 20
    """A checkpoint is good once this many steps after it passed the monitors with no bad step."""

    def validate(self) -> None:
        """Raise ValueError naming the key and the allowed values."""

        def need(cond: bool, key: str, what: str) -> None:
            if not cond:
                raise ValueError(f"monitor.{key}={getattr(self, key)!r}: must be {what}")

        need(self.warmup_steps >= 0, "warmup_steps", ">= 0")
        need(0.0 < self.ema_beta < 1.0, "ema_beta", "in (0, 1), e.g. 0.98")
        need(self.winsor_z > 0, "winsor_z", "> 0")
        for key in ("loss_spike_z", "grad_norm_spike_z", "fp8_amax_growth_max", "shadow_rel_tol"):
            need(getattr(self, key) > 0, key, "> 0")
        need(self.fp8_amax_growth_max > 1, "fp8_amax_growth_max", "> 1 (a growth ratio)")
        for key in ("loss_std_floor_rel", "loss_std_floor_abs", "grad_norm_log_std_floor"):
            need(getattr(self, key) >= 0, key, ">= 0")
        need(self.eval_gap_max >= 0, "eval_gap_max", ">= 0 (0 = no BF16 evaluation)")
        for key in ("fp8_saturated_frac_max", "fp8_underflow_frac_max"):
            need(0.0 <= getattr(self, key) <= 1.0, key, "a fraction in [0, 1]")
        for key in ("shadow_every", "skips_before_escalation", "max_relapses", "max_rollbacks",
                    "rollback_skip_samples", "good_after_steps"):
            need(getattr(self, key) >= 0, key, ">= 0")
        for key in ("escalation_window", "skip_window", "cooldown_steps", "relapse_window"):
            need(getattr(self, key) >= 1, key, ">= 1")
        need(self.max_skips_per_window >= 0, "max_skips_per_window", ">= 0")
        need(self.fallback_scope in ("model", "layers"), "fallback_scope", "one of 'model', 'layers'")
        need(0.0 < self.rollback_lr_scale <= 1.0, "rollback_lr_scale", "in (0, 1]")


# Fault injection (orchestration/training/faults.py reads these).
FAULT_KINDS = tuple(k.value for k in FaultKind)
PROCESS_FAULTS = ("kill_worker", "crash")
DEFAULT_MAGNITUDE = {"loss_spike": 100.0, "fp8_overflow": 1e6, "fp8_scale_error": 1.0}


@dataclass
class FaultConfig:
    """Which fault to inject, where and when (conf/faults)."""

    kind: FaultKind = FaultKind.none
    """none | nan_grad | loss_spike | fp8_overflow | kill_worker | crash.
    nan_grad: one gradient element of this rank's shard becomes NaN (after backward).
    loss_spike: the loss (and so every gradient) is multiplied by `magnitude`.
    fp8_overflow: one element of the input of the hooked layer becomes `magnitude` x its amax, an outlier that
    crushes the FP8 dynamic range (underflow, amax growth) or saturates with delayed scaling.
    fp8_scale_error: the outputs of the transformer blocks' FP8 linears get a per-channel scale error exp(magnitude *
    N(0, 1)), drawn anew each step, while they run in FP8 (wrong dequantization scales): the FP8 path gets worse
    without any NaN; BF16 is untouched.
    kill_worker: the process SIGKILLs itself (like a lost node). crash: raises InjectedCrash (a Python failure)."""
    rank: int = 0
    """Rank that sees the fault; -1 = every rank."""
    step: int = 0
    """First step hit."""
    num_steps: int = 1
    """Consecutive steps hit from `step` on (tensor faults; process faults fire at `step` only)."""
    magnitude: float = 0.0
    """Scale of loss_spike / fp8_overflow; 0 = the kind's default (loss x100, outlier 1e6 x amax)."""
    marker_dir: str | None = None
    """Absolute directory for fired markers; kill_worker and crash need one (FaultInjector defaults it to a
    directory of the run), optional for the others."""

    def validate(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"faults.kind={self.kind!r}: must be one of {', '.join(FAULT_KINDS)}")
        if self.rank < -1:
            raise ValueError(f"faults.rank={self.rank}: must be a rank >= 0, or -1 for every rank")
        if self.step < 0:
            raise ValueError(f"faults.step={self.step}: must be >= 0")
        if self.num_steps < 1:
            raise ValueError(f"faults.num_steps={self.num_steps}: must be >= 1")
        if self.magnitude < 0:
            raise ValueError(f"faults.magnitude={self.magnitude}: must be >= 0 (0 = default for the kind)")
        if self.marker_dir and not os.path.isabs(self.marker_dir):
            raise ValueError(f"faults.marker_dir={self.marker_dir!r}: must be absolute (Ray workers run in "
                             "/tmp/ray/session_*)")

    @property
    def effective_magnitude(self) -> float:
        return self.magnitude or DEFAULT_MAGNITUDE.get(self.kind, 0.0)


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


# Hydra composes conf/config.yaml onto this schema (its defaults list starts with `base_job`), so `launch.py --cfg job`
# shows the typed config and a wrong type or an unknown key fails in Hydra, naming the key. Registered on import:
# every entry point that composes (launch.py, orchestration/driver/torchrun.py, tests) imports this module first.
BASE_JOB_SCHEMA = "base_job"


def register_job_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=BASE_JOB_SCHEMA, node=JobConfig)


register_job_schema()


def _plain_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: value.value if isinstance(value, Enum) else value for key, value in pairs}


def to_dict(job: JobConfig) -> dict[str, Any]:
    """Plain data (Enums as their strings): what config.yaml, W&B and the workers get."""
    return dataclasses.asdict(job, dict_factory=_plain_fields)


SECRET_MARKERS = ("key", "token", "password", "secret")
# Names with a marker in them that hold no credential: data.tokenizer is a file path a resume and W&B must show.
NOT_SECRET_KEYS = ("tokenizer",)


def is_secret_key(key: Any) -> bool:
    """The one rule for what counts as a credential (config.yaml masks it, W&B drops it)."""
    k = str(key).lower()
    return k not in NOT_SECRET_KEYS and any(marker in k for marker in SECRET_MARKERS)


def redact_secrets(data: Any) -> Any:
    """Mask values whose key looks like a credential, recursively (config.yaml must never hold them)."""
    if isinstance(data, dict):
        return {k: ("<redacted>" if is_secret_key(k) else redact_secrets(v))
                for k, v in data.items()}
    if isinstance(data, list):
        return [redact_secrets(v) for v in data]
    return data
