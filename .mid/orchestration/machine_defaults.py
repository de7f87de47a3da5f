"""The defaults that depend on the machine: cluster shape from the GPUs there are, data shape from the model.

Settings left null in the config (cluster.min_workers, max_workers, device=auto, gpus_per_worker,
memory_per_worker_gb, data.seq_len, train.global_batch_size, train.micro_batch_size) are decided here from a
`Machine`, what orchestration/driver/machine.py detected (this machine's GPUs for the embedded cluster, Ray's node
resources for a joined one). Pure: tests hand it any machine, an AMD one included. A value the user set is never
changed. Each decision comes with a note that says what was detected and why, for the plan's first lines.

GPU jobs follow the model: the published context length (the flavor's RoPE range, max_seq_len), a global batch of
the flavor's tokens per GPU step on every GPU of the elastic range, and the largest micro-batch the memory plan fits
(gradient accumulation makes up the rest). CPU jobs keep the small debug shapes of the 2-worker demo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestration.config import JobConfig

# The CPU demo (the default job on a machine without GPUs): 2 workers of 8 GiB, 16 sequences of 128 tokens a step.
CPU_WORKERS = 2
CPU_MEMORY_PER_WORKER_GB = 8.0
CPU_SEQ_LEN = 128
CPU_GLOBAL_BATCH = 16
CPU_MICRO_BATCH = 4


@dataclass(frozen=True)
class Machine:
    """What the job can run on: GPUs of one vendor (or none), how many, and the memory of each."""

    gpu_vendor: str | None = None  # "cuda" | "rocm" | None (no GPU)
    gpu_count: int = 0
    gpu_memory_gb: float | None = None  # GiB per GPU, as torch reports it; None when unknown
    gpu_name: str = ""
    source: str = "no GPU visible"  # how it was found, for the plan

    @property
    def has_gpus(self) -> bool:
        return self.gpu_vendor is not None and self.gpu_count > 0


NO_GPU = Machine()


def is_gpu_job(job: JobConfig) -> bool:
    """Whether the job's workers train on GPUs: a GPU device, or device=auto with GPUs per worker (its workers pick
    the vendor)."""
    c = job.cluster
    return c.device in ("cuda", "rocm") or (c.device == "auto" and bool(c.gpus_per_worker))


def resolve_cluster(job: JobConfig, machine: Machine) -> list[str]:
    """Fill the cluster settings left null from the machine; returns the notes saying what was decided."""
    c = job.cluster
    notes: list[str] = []
    decided = []
    if c.device == "auto":
        if machine.has_gpus:
            c.device = machine.gpu_vendor
        elif not c.gpus_per_worker:
            c.device = "cpu"
        # else GPUs asked for on a cluster not seen from here (a preset serving NVIDIA and AMD alike): each worker
        # picks its vendor's device (orchestration/training/process_group.pick_device)
        decided.append("device")
    gpu = is_gpu_job(job)
    if c.gpus_per_worker is None:
        c.gpus_per_worker = 1.0 if gpu else 0.0
        decided.append("gpus_per_worker")
    if c.min_workers is None or c.max_workers is None:
        if gpu and machine.has_gpus and c.gpus_per_worker > 0:
            workers = max(1, int(machine.gpu_count // c.gpus_per_worker))
        elif gpu:
            workers = 1  # planning GPUs this machine does not have (a dry run): one unless told
        else:
            workers = CPU_WORKERS
        if c.min_workers is None and c.max_workers is None:
            c.min_workers = c.max_workers = workers
        elif c.min_workers is None:
            c.min_workers = min(workers, c.max_workers)
        else:
            c.max_workers = max(workers, c.min_workers)
        decided.append("workers")
    if c.memory_per_worker_gb is None:
        if gpu and machine.has_gpus and machine.gpu_memory_gb:
            c.memory_per_worker_gb = round(machine.gpu_memory_gb * max(c.gpus_per_worker, 1.0), 1)
        elif gpu:
            c.memory_per_worker_gb = DEFAULT_GPU_MEMORY_GB
            notes.append(f"cluster.memory_per_worker_gb: the GPUs' memory is unknown here, {DEFAULT_GPU_MEMORY_GB} "
                         "GiB assumed (an 80 GB card); set cluster.memory_per_worker_gb for yours")
        else:
            c.memory_per_worker_gb = CPU_MEMORY_PER_WORKER_GB
        decided.append("memory_per_worker_gb")
    if decided:
        if gpu:
            what = (f"{c.min_workers}" if c.min_workers == c.max_workers else f"{c.min_workers}..{c.max_workers}")
            notes.insert(0, f"cluster: {what} {c.device} worker(s), {c.gpus_per_worker:g} GPU and "
                            f"{c.memory_per_worker_gb:g} GiB each, from {machine.source}"
                            + ("" if machine.has_gpus else " (no GPU here: planning only)"))
        else:
            what = (f"{c.min_workers}" if c.min_workers == c.max_workers else f"{c.min_workers}..{c.max_workers}")
            notes.insert(0, f"cluster: {what} CPU workers of {c.memory_per_worker_gb:g} GiB "
                            f"(the CPU demo), since {machine.source}; cluster.device=cuda plans GPUs")
    return notes


# An 80 GB card's memory as torch reports it (an H100 SXM shows 79.1 GiB): what a GPU plan assumes when nothing
# says better (planning GPUs on a machine that has none).
DEFAULT_GPU_MEMORY_GB = 79.0


def resolve_data_shape(job: JobConfig) -> list[str]:
    """Fill data.seq_len, train.global_batch_size and train.micro_batch_size left null (after resolve_cluster)."""
    from models.registry import MODEL_FLAVORS, resolve_flavor

    notes: list[str] = []
    d, t, c = job.data, job.train, job.cluster
    gpu = is_gpu_job(job)
    if job.model.name not in MODEL_FLAVORS:  # validate names the unknown model
        d.seq_len = d.seq_len or CPU_SEQ_LEN
        t.global_batch_size = t.global_batch_size or CPU_GLOBAL_BATCH
        t.micro_batch_size = t.micro_batch_size or CPU_MICRO_BATCH
        return notes
    if not gpu:
        d.seq_len = d.seq_len or CPU_SEQ_LEN
        t.global_batch_size = t.global_batch_size or max(CPU_GLOBAL_BATCH, c.max_workers)
        t.micro_batch_size = t.micro_batch_size or CPU_MICRO_BATCH
        return notes
    try:
        flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    except (ValueError, TypeError):  # a bad override: validate reports it
        flavor = MODEL_FLAVORS[job.model.name]
    if d.seq_len is None:
        # The preset's context (its pretraining length): an override that widens the RoPE range (a Hugging Face
        # config of Llama 3.1 says 131072) does not make every sequence that long.
        d.seq_len = min(flavor.args.max_seq_len, MODEL_FLAVORS[job.model.name].args.max_seq_len)
        notes.append(f"data.seq_len {d.seq_len}: {flavor.name}'s context length")
    if t.global_batch_size is None:
        per_gpu = max(1, flavor.tokens_per_gpu_step // d.seq_len)
        t.global_batch_size = per_gpu * c.max_workers
        notes.append(f"train.global_batch_size {t.global_batch_size} sequences ({t.global_batch_size * d.seq_len:,} "
                     f"tokens): {flavor.name}'s {flavor.tokens_per_gpu_step:,} tokens per GPU step on "
                     f"{c.max_workers} GPU(s)")
    if t.micro_batch_size is None:
        t.micro_batch_size, why = largest_fitting_micro_batch(job)
        notes.append(f"train.micro_batch_size {t.micro_batch_size}: {why}")
    return notes


def largest_fitting_micro_batch(job: JobConfig) -> tuple[int, str]:
    """The largest micro-batch (dividing each worker's share of the global batch at the smallest world size, so no
    worker gets a ragged last micro-batch) whose memory plan fits a worker; 1 when none fits (the plan then says
    why)."""
    from models.registry import build_model, resolve_flavor
    from orchestration.training.model_setup import plan_fp8, plan_worker_memory

    c, t = job.cluster, job.train
    world = c.min_workers
    share = math.ceil(t.global_batch_size / world)
    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    if job.data.seq_len > flavor.args.max_seq_len:
        return 1, "data.seq_len beyond the model's range (see the error)"
    model = build_model(flavor, device="meta")
    memory = int(c.memory_per_worker_gb * 1024**3)
    for micro in range(share, 0, -1):
        if share % micro:
            continue
        # The micro-batch chosen becomes the configured one, which decides the layers the workers run in FP8.
        converted = plan_fp8(job, on_gpu=is_gpu_job(job), micro_batch=micro, model=model).converted
        if plan_worker_memory(job, world, micro, flavor, model, converted).fits(memory):
            accum = share // micro
            return micro, (f"the largest that fits {c.memory_per_worker_gb:g} GiB at {world} worker(s)"
                           + (f", x{accum} gradient accumulation" if accum > 1 else ""))
    return 1, f"not even 1 sequence fits {c.memory_per_worker_gb:g} GiB at {world} worker(s)"


def resolve_machine_defaults(job: JobConfig, machine: Machine = NO_GPU) -> list[str]:
    """Every machine-dependent default of the job, in order (cluster first: the data shape depends on it)."""
    return resolve_cluster(job, machine) + resolve_data_shape(job)
