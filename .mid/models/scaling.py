"""Scaling model: step time, tokens/s per GPU, MFU and scaling efficiency of FSDP2 training on 1 to 1,024 GPUs.

Pure functions of numbers (no torch, nothing of orchestration): the planner (orchestration/driver/plan.py) fills a
`Workload` from a meta-built model and a single-GPU step time measured on the product (MEASURED_STEPS, read from the
benchmark result files in benchmarks/results/), and `scaling_curve` predicts every world size for a `Fabric` preset.

The model, per training step of one GPU (FSDP2, one unit per transformer block, resharded after forward):
- compute: the measured single-GPU step scaled to this workload, its blocks by their time per model FLOP and its
  output head apart (`workload_from_measurement`); the optimizer step, sharded, shrinks as 1/N. Activation checkpointing runs `recompute_fraction` of each block's forward again in
  backward (1 for whole-block checkpointing: +1/3 of the blocks' compute);
- communication: each block's parameters are all-gathered twice (forward, and again for backward) and its gradients
  reduce-scattered once; the root's (embedding, head, final norm) once each. A collective of B bytes (the unsharded
  size) over N GPUs is NCCL's ring: each GPU passes on B (N - 1) / N bytes. Inside a node they all cross NVLink /
  Infinity Fabric; across nodes NCCL runs one ring per NIC (channel), each leaving every node through a different
  GPU's NIC, so a GPU's NIC carries 1 / gpus_per_node of its ring traffic and NVLink the rest, concurrently. The
  latency is NCCL's ring model: a base plus one step per rank, the node-crossing steps at the network's latency;
- overlap: FSDP2 gathers block i + 1 while block i computes (forward 1/3 of a block's compute, backward 2/3 plus the
  recomputed forward, with the next gather and this block's reduce-scatter); what does not fit is exposed. Hidden
  communication still slows compute (the collectives' kernels take SMs and memory bandwidth):
  `Fabric.overlap_slowdown` of its time;
- FP8: compute divided by the measured FP8 speedup; with the FP8 all-gather the tensorwise linears' weights travel
  in one byte per element (the rest in the gather dtype).
MFU is against the accelerator's dense bf16 peak (as torchtitan reports it, FP8 runs included).
Validated against published runs (PUBLISHED_RUNS, `validate_published`; docs/scaling.md, tests/test_scaling.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_tflops: float  # dense peak, datasheet
    fp8_tflops: float


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("h100", 989.0, 1979.0),
    Accelerator("h200", 989.0, 1979.0),
    Accelerator("mi300x", 1307.0, 2615.0),
)}


@dataclass(frozen=True)
class Fabric:
    """How GPUs talk: the bandwidth a GPU's ring collective reaches inside a node (NVLink / Infinity Fabric, GB/s
    one direction) and that of each GPU's own NIC across nodes, NCCL's per-step ring latencies on each, and the
    slowdown hidden communication inflicts on compute."""

    name: str
    description: str
    accelerator: str
    gpus_per_node: int
    intra_node_gbs: float
    inter_node_gbs: float  # one GPU's NIC (one NIC per GPU: NCCL puts one ring channel on each)
    intra_hop_us: float
    inter_hop_us: float
    overlap_slowdown: float = 0.1
    collective_base_us: float = 8.4  # NCCL's base latency of a ring collective (Simple protocol)


# Bandwidths are what NCCL/RCCL all-gathers reach (bus bandwidth), not link rates: NVLink 4 (450 GB/s a direction,
# H100 SXM datasheet: 900 GB/s bidirectional) reaches ~360 GB/s in nccl-tests all_gather on 8xH100; a 400 Gb/s NIC per
# GPU (50 GB/s) ~45 over InfiniBand, ~40 over RoCE; AWS EFA on p5 (3200 Gb/s a node, 50 GB/s a GPU) ~30 for NCCL
# through aws-ofi-nccl; MI300X's Infinity Fabric (7 links of 64 GB/s a direction) ~300 in rccl-tests. Across nodes
# the node's NICs work together (the ring model above), so an 8x H100 node with 8 NDR NICs reaches about 8 x 45 =
# 360 GB/s of bus bandwidth: published multi-node nccl-tests on H100 SXM with NDR InfiniBand report 400-450 GB/s of
# all_reduce bus bandwidth (saturncloud.io/blog/crusoe-nccl-cluster-validation), which a per-GPU NIC bottleneck (45)
# could not. Latencies are NCCL's own cost model (src/graph/tuning.cc, ring, Simple protocol, which large FSDP
# collectives use): 8.4 us base, 3.4 us a step over NVLink, 14 us a step over the network. Assumed, no published
# per-step figure at hand: a RoCE step 1.4x and an EFA step 2x an InfiniBand one, 3 us a step over Infinity Fabric.
FABRICS: dict[str, Fabric] = {f.name: f for f in (
    Fabric("nvlink_ib400", "8x H100 per node, NVLink 4 + InfiniBand NDR 400G per GPU", "h100", 8, 360.0, 45.0, 3.4,
           14.0),
    Fabric("nvlink_roce400", "8x H100 per node, NVLink 4 + RoCE 400G per GPU", "h100", 8, 360.0, 40.0, 3.4, 19.6),
    Fabric("aws_efa", "AWS p5: 8x H100 per node, NVLink 4 + EFA 3200 Gb/s per node", "h100", 8, 360.0, 30.0, 3.4, 28.0),
    Fabric("mi300x_roce400", "8x MI300X per node, Infinity Fabric + RoCE 400G per GPU", "mi300x", 8, 300.0, 40.0, 3.0,
           19.6),
)}

WORLD_SIZES = tuple(2**i for i in range(11))  # 1 .. 1024


@dataclass(frozen=True)
class Workload:
    """One GPU's step and what FSDP2 moves for it. Parameter counts are of the whole model (FSDP shards them; every
    rank gathers all of them). compute_s: the step's compute on one GPU of `accelerator` in bf16, optimizer left out."""

    name: str
    accelerator: str
    tokens_per_gpu: int
    flops_per_token: float
    layers: int
    params_per_layer: float
    params_root: float  # embedding, output head, final norm: one FSDP unit, gathered once a step
    fp8_gather_fraction: float  # of a block's parameters in tensorwise FP8 linears (what the FP8 all-gather sends)
    compute_s: float
    fp8_compute_speedup: float  # bf16 compute / fp8 compute, measured on one GPU
    optimizer_s: float = 0.0  # the optimizer step on one GPU over all parameters; sharded as 1/N
    head_flops_per_token: float = 0.0  # of flops_per_token, the output head's (outside the blocks, never recomputed)
    # Activation checkpointing: the share of each block's forward compute run again in backward (0 none, 1 whole-block
    # checkpointing; a selective policy in between).
    recompute_fraction: float = 0.0
    # MoE: the routed experts' parameters of the whole model (of layers * params_per_layer), the MoE blocks, the
    # width a routed row carries (model dim) and the experts a token goes to (top-k): what expert parallelism keeps
    # out of the all-gathers and sends by all-to-all instead.
    expert_params: float = 0.0
    moe_layers: int = 0
    dim: int = 0
    top_k: int = 0


@dataclass(frozen=True)
class Layout:
    """How the GPUs split the model. shard_group_size: FSDP shards every parameter over this many consecutive GPUs
    (None: all of them); the world_size / shard_group_size replicas of a group all-reduce their gradient shards
    (HSDP). expert_parallel N: each GPU holds E / N routed experts whole (no all-gather for them), tokens reach them
    by all-to-all (dispatch and combine, both again in backward), and the W / N replicas of an expert all-reduce its
    gradient (orchestration/training/expert_parallel.py). fp8_dispatch: the dispatch sends 1 byte an element."""

    shard_group_size: int | None = None
    expert_parallel: int = 1
    fp8_dispatch: bool = False

    def label(self, world_size: int) -> str:
        group = min(self.shard_group_size or world_size, world_size)
        text = f"fsdp {group}" if group == world_size else f"hsdp {world_size // group}x{group}"
        return text + (f" + ep {self.expert_parallel}" if self.expert_parallel > 1 else "")


@dataclass(frozen=True)
class Precision:
    fp8: bool
    fp8_all_gather: bool
    gather_bytes: int = 2  # FSDP param_dtype: 2 bf16, 4 float32
    reduce_bytes: int = 4  # FSDP reduce_dtype

    @property
    def label(self) -> str:
        if not self.fp8:
            return "bf16"
        return "fp8 + fp8 all-gather" if self.fp8_all_gather else "fp8"


@dataclass(frozen=True)
class StepPrediction:
    world_size: int
    step_s: float
    compute_s: float  # recompute_s included
    recompute_s: float  # activation checkpointing's forward run again in backward
    comm_s: float  # all collectives of the step, back to back
    exposed_comm_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    scaling_efficiency: float  # tokens/s per GPU against one GPU of the same precision

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def ring_collective_s(unsharded_bytes: float, world_size: int, fabric: Fabric) -> float:
    """One ring all-gather (or reduce-scatter) of a tensor of `unsharded_bytes` over `world_size` GPUs (NCCL's ring:
    module docstring)."""
    if world_size <= 1:
        return 0.0
    g = fabric.gpus_per_node
    nodes = math.ceil(world_size / g)
    ring_bytes = unsharded_bytes * (world_size - 1) / world_size
    if nodes == 1:
        transfer = ring_bytes / (fabric.intra_node_gbs * 1e9)
    else:
        transfer = max(ring_bytes * (g - 1) / g / (fabric.intra_node_gbs * 1e9),
                       ring_bytes / g / (fabric.inter_node_gbs * 1e9))
    crossings = nodes - 1
    latency_us = (fabric.collective_base_us + (world_size - 1 - crossings) * fabric.intra_hop_us
                  + crossings * fabric.inter_hop_us)
    return transfer + latency_us * 1e-6


def strided_ring_s(unsharded_bytes: float, ranks: int, stride: int, fabric: Fabric) -> float:
    """One ring reduce-scatter (or all-gather) over `ranks` GPUs that are `stride` ranks apart (the replicas of an
    HSDP shard group or of an expert shard): with a stride of a node or more, every GPU's ring runs through its own
    NIC, each GPU of a node in a different ring; with a smaller one, the members of a node share it as in
    ring_collective_s."""
    if ranks <= 1:
        return 0.0
    per_node = max(1, fabric.gpus_per_node // stride)
    if per_node > 1:
        return ring_collective_s(unsharded_bytes, ranks, dataclasses.replace(fabric, gpus_per_node=per_node))
    transfer = unsharded_bytes * (ranks - 1) / ranks / (fabric.inter_node_gbs * 1e9)
    return transfer + (fabric.collective_base_us + (ranks - 1) * fabric.inter_hop_us) * 1e-6


def all_to_all_s(bytes_per_gpu: float, ranks: int, fabric: Fabric) -> float:
    """One all-to-all in which each GPU holds `bytes_per_gpu` spread evenly over `ranks` consecutive GPUs: the
    share for the others leaves at once, over NVLink to the GPUs of its node and through its own NIC to the rest."""
    if ranks <= 1:
        return 0.0
    g = fabric.gpus_per_node
    out = bytes_per_gpu * (ranks - 1) / ranks
    if ranks <= g:
        return out / (fabric.intra_node_gbs * 1e9) + (fabric.collective_base_us + fabric.intra_hop_us) * 1e-6
    remote = (ranks - g) / (ranks - 1)
    transfer = max(out * (1 - remote) / (fabric.intra_node_gbs * 1e9), out * remote / (fabric.inter_node_gbs * 1e9))
    return transfer + (fabric.collective_base_us + fabric.inter_hop_us) * 1e-6


def predict_step(w: Workload, p: Precision, fabric: Fabric, world_size: int,
                 layout: Layout = Layout()) -> StepPrediction:
    """Step time of one GPU among `world_size` (module docstring for the model)."""
    accel = ACCELERATORS[fabric.accelerator]
    compute = w.compute_s * ACCELERATORS[w.accelerator].bf16_tflops / accel.bf16_tflops
    if p.fp8:
        compute /= w.fp8_compute_speedup
    per_block = compute * (1.0 - w.head_flops_per_token / w.flops_per_token) / w.layers
    fwd = per_block / 3
    recompute = w.recompute_fraction * fwd
    bwd = 2 * per_block / 3 + recompute
    compute += w.layers * recompute
    group = min(layout.shard_group_size or world_size, world_size)
    replicas = world_size // group
    ep = layout.expert_parallel if world_size > 1 else 1
    expert_block = w.expert_params / w.layers if ep > 1 else 0.0  # kept out of FSDP under expert parallelism
    dense_block = w.params_per_layer - expert_block
    fp8_share = w.fp8_gather_fraction * w.params_per_layer / dense_block if (p.fp8 and p.fp8_all_gather) else 0.0
    block_gather_bytes = dense_block * (fp8_share * 1 + (1 - fp8_share) * p.gather_bytes)
    ag = ring_collective_s(block_gather_bytes, group, fabric)
    rs = ring_collective_s(dense_block * p.reduce_bytes, group, fabric)
    # HSDP: each GPU's gradient shard all-reduced over its replicas (a reduce-scatter plus an all-gather)
    rs += 2 * strided_ring_s(dense_block * p.reduce_bytes / group, replicas, group, fabric)
    # expert parallelism: the GPU's experts' gradient all-reduced over their W / N replicas
    rs += 2 * strided_ring_s(expert_block / ep * p.reduce_bytes, world_size // ep, ep, fabric)
    root_ag = ring_collective_s(w.params_root * p.gather_bytes, group, fabric)
    root_rs = ring_collective_s(w.params_root * p.reduce_bytes, group, fabric)
    root_rs += 2 * strided_ring_s(w.params_root * p.reduce_bytes / group, replicas, group, fabric)
    # The routed rows: dispatch and combine in forward, both again in backward, on the critical path (the experts
    # wait for their rows, the block's output for the results): exposed whole.
    a2a = 0.0
    if ep > 1:
        rows = w.tokens_per_gpu * w.top_k * w.dim
        dispatch = rows * (1 + 4 / w.dim if layout.fp8_dispatch else 2)  # e4m3 plus a float32 scale per row
        a2a = w.moe_layers * (all_to_all_s(dispatch, ep, fabric) + 3 * all_to_all_s(rows * 2, ep, fabric))
    comm = w.layers * (2 * ag + rs) + root_ag + root_rs + a2a
    # The root's gather starts the step and its reduce-scatter ends it; the first block's gather waits for nothing
    # to hide behind either.
    exposed = root_ag + root_rs + ag + w.layers * (max(0.0, ag - fwd) + max(0.0, ag + rs - bwd))
    exposed = min(exposed, comm - a2a) + a2a
    params_total = w.layers * w.params_per_layer + w.params_root
    expert_share = (w.expert_params if ep > 1 else 0.0) / params_total
    optimizer = w.optimizer_s * ((1 - expert_share) / group + expert_share / ep)
    step = compute + optimizer + exposed + fabric.overlap_slowdown * (comm - exposed)
    tps = w.tokens_per_gpu / step
    mfu = tps * w.flops_per_token / (accel.bf16_tflops * 1e12)
    return StepPrediction(world_size, step, compute, w.layers * recompute, comm, exposed, tps, mfu, float("nan"))


def scaling_curve(w: Workload, p: Precision, fabric: Fabric,
                  world_sizes: tuple[int, ...] = WORLD_SIZES, layout: Layout = Layout()) -> list[StepPrediction]:
    """predict_step at each world size, with the scaling efficiency against one GPU."""
    one = predict_step(w, p, fabric, 1).tokens_per_s_per_gpu
    return [dataclasses.replace(s, scaling_efficiency=s.tokens_per_s_per_gpu / one)
            for s in (predict_step(w, p, fabric, n, layout_at(layout, n)) for n in world_sizes)]


def layout_at(layout: Layout, world_size: int) -> Layout:
    """The layout at a world size too small for it: the degrees capped by the world size (powers of two here)."""
    return dataclasses.replace(layout, expert_parallel=min(layout.expert_parallel, world_size),
                               shard_group_size=None if layout.shard_group_size is None
                               else min(layout.shard_group_size, world_size))


def state_bytes_per_gpu(w: Workload, layout: Layout, world_size: int, bytes_per_param: int = 16) -> float:
    """Parameters, gradients and AdamW states of one GPU (fp32 master, grad, m, v: 16 bytes a parameter): the dense
    part sharded over the shard group, the routed experts over the expert-parallel group; plus FSDP's working
    buffers: the root and two blocks gathered in bf16 (the one computing, the one prefetched), and the biggest
    unit's fp32 gradient before its reduce-scatter (the routed experts out of the blocks under expert parallelism)."""
    params_total = w.layers * w.params_per_layer + w.params_root
    group = min(layout.shard_group_size or world_size, world_size)
    experts = w.expert_params if layout.expert_parallel > 1 else 0.0
    state = bytes_per_param * ((params_total - experts) / group + experts / layout.expert_parallel)
    block = w.params_per_layer - experts / w.layers
    buffers = 2 * w.params_root + 2 * 2 * block + 4 * max(w.params_root, block) if group > 1 else 0.0
    return state + buffers


def candidate_layouts(world_size: int, gpus_per_node: int, n_experts: int) -> list[Layout]:
    """FSDP or HSDP (one node a shard group) times expert parallelism over 1, 2, 4, ... up to the world or the
    routed experts, each a divisor of the world size and of the routed experts."""
    groups = [None] + ([gpus_per_node] if world_size > gpus_per_node and world_size % gpus_per_node == 0 else [])
    eps = [1]
    n = 2
    while n_experts and n <= min(world_size, n_experts):
        if world_size % n == 0 and n_experts % n == 0:
            eps.append(n)
        n *= 2
    return [Layout(g, e) for g in groups for e in eps]


def choose_layout(w: Workload, p: Precision, fabric: Fabric, world_size: int, n_experts: int,
                  memory_bytes: float, activation_bytes: float) -> tuple[Layout, StepPrediction, list[dict]]:
    """The candidate layout (candidate_layouts) with the most tokens/s per GPU among those whose state plus
    `activation_bytes` fit `memory_bytes` per GPU (90 %: the allocator's slack); all of them if none fits. Returns
    it, its prediction, and every candidate's row."""
    rows = []
    for layout in candidate_layouts(world_size, fabric.gpus_per_node, n_experts):
        pred = predict_step(w, p, fabric, world_size, layout)
        mem = state_bytes_per_gpu(w, layout, world_size) + activation_bytes
        rows.append({"layout": layout.label(world_size), "shard_group_size": layout.shard_group_size,
                     "expert_parallel": layout.expert_parallel, "bytes_per_gpu": mem,
                     "fits": mem <= 0.9 * memory_bytes, "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu,
                     "_layout": layout, "_pred": pred})
    pool = [r for r in rows if r["fits"]] or rows
    best = max(pool, key=lambda r: r["tokens_per_s_per_gpu"])
    return best["_layout"], best["_pred"], [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def calibrate_compute(w: Workload, p: Precision, fabric: Fabric, world_size: int,
                      tokens_per_s_per_gpu: float) -> Workload:
    """The workload whose bf16 compute makes predict_step give `tokens_per_s_per_gpu` at `world_size` (for a
    published run whose single-GPU time is not published): the step is increasing in compute, so bisect."""
    lo, hi = 1e-6, 1e4
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        tps = predict_step(dataclasses.replace(w, compute_s=mid), p, fabric, world_size).tokens_per_s_per_gpu
        lo, hi = (mid, hi) if tps > tokens_per_s_per_gpu else (lo, mid)
    return dataclasses.replace(w, compute_s=math.sqrt(lo * hi))


def fp8_compute_speedup(layer_speedup: float, bf16_fraction: float) -> float:
    """Whole-step compute speedup when a `bf16_fraction` of the compute (the output head, say) stays in bf16 and the
    rest speeds up by `layer_speedup`."""
    return 1.0 / ((1.0 - bf16_fraction) / layer_speedup + bf16_fraction)


# ---------------------------------------------------------------------------------------------------------------
# Single-GPU measurements of the product, the compute input: read from the training-step benchmark's result files
# (benchmarks/train_step.py through benchmarks/run_suite.py; BENCHMARKS.md, "Training step vs bf16 and torchao").

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# The result file of each family's measured step, and the rows the planner reads: bf16, and the product's FP8 default
# (tensorwise with the fused FP8 head).
MEASURED_STEP_FILES = {"llama3_8b": "train_step_dense.json", "deepseek_moe16b": "train_step_moe.json"}
BF16_VARIANT = "bf16"
FP8_VARIANT = "ours_head:tensorwise"


@dataclass(frozen=True)
class MeasuredStep:
    """One GPU's measured step: `overrides` of the flavor as timed (fewer layers), tokens per step, seconds."""

    flavor: str
    overrides: dict
    seq_len: int
    tokens: int
    accelerator: str
    bf16_s: float
    fp8_s: float
    optimizer_s: float  # of those seconds, the optimizer step (its kernels' time in the bf16 run's profile)
    source: str
    # From each run's profile: the dense GEMMs' time (nn.Linear, the output head's included) and the loss kernels'
    # (cross-entropy, the head's softmax), to tell the head's time from the blocks'.
    bf16_gemm_s: float = 0.0
    fp8_gemm_s: float = 0.0
    bf16_loss_s: float = 0.0
    fp8_loss_s: float = 0.0


def accelerator_of(device_name: str) -> str:
    """The ACCELERATORS key a device name (torch.cuda.get_device_name) names, e.g. "NVIDIA H100 80GB HBM3" -> h100."""
    name = device_name.lower().replace(" ", "")
    found = [key for key in ACCELERATORS if key in name]
    if len(found) != 1:
        raise ValueError(f"device {device_name!r} is none of the accelerators {sorted(ACCELERATORS)}: add it there")
    return found[0]


def measured_step_from_result(result: dict, source: str) -> MeasuredStep:
    """The MeasuredStep of a train_step result file (parsed JSON): its one config, the bf16 and FP8 rows' medians."""
    (config,) = result["results"]["configs"]
    rows = {row["variant"]: row for row in config["rows"]}
    bf16, fp8 = rows[BF16_VARIANT], rows[FP8_VARIANT]
    device = result["results"]["env"]["device"]
    b, f = bf16["profile_breakdown"], fp8["profile_breakdown"]
    return MeasuredStep(config["model"], dict(config["overrides"]), config["seq"], config["tokens_per_step"],
                        accelerator_of(device), bf16["ms"] / 1e3, fp8["ms"] / 1e3, b["optimizer"]["ms"] / 1e3,
                        f"{source} ({device})", b["gemm"]["ms"] / 1e3, f["gemm"]["ms"] / 1e3,
                        b["cross_entropy_head"]["ms"] / 1e3, f["cross_entropy_head"]["ms"] / 1e3)


def load_measured_steps(results_dir: Path = RESULTS_DIR) -> dict[str, MeasuredStep]:
    """Each family's measured step whose result file is there (none without the repository's benchmarks/results/:
    the planner then says that scaling has no measurement to start from)."""
    steps = {}
    for name, file in MEASURED_STEP_FILES.items():
        path = results_dir / file
        if path.is_file():
            steps[name] = measured_step_from_result(json.loads(path.read_text()), f"benchmarks/results/{file}")
    return steps


MEASURED_STEPS: dict[str, MeasuredStep] = load_measured_steps()


def workload_from_measurement(name: str, m: MeasuredStep, measured_flops_per_token: float, flops_per_token: float,
                              tokens_per_gpu: int, layers: int, params_total: float, params_root: float,
                              fp8_gather_fraction: float, recipe_fp8_speedup: float | None = None,
                              head_flops_per_token: float = 0.0, recompute_fraction: float = 0.0,
                              measured_head_flops_per_token: float = 0.0,
                              measured_head_gemm_share: float = 0.0) -> Workload:
    """A Workload whose compute is the measured step's (optimizer left out) scaled to this model: the blocks at their
    measured time per FLOP, the output head at its own. The measured step has fewer layers, so its head weighs far
    more in it (a third of a 4-layer Llama3-8B's FLOPs, a twentieth of the 32-layer model's) and runs at another
    speed, FP8 most of all; its time is the dense GEMMs' profiled time times the head's share of their FLOPs
    (`measured_head_gemm_share`) plus the loss kernels'. Without measured_head_flops_per_token the whole step is
    taken at one time per FLOP. recipe_fp8_speedup: the measured fp8 speedup unless given."""
    def compute_s(step_s: float, gemm_s: float, loss_s: float) -> float:
        head_s = (gemm_s * measured_head_gemm_share + loss_s) if measured_head_flops_per_token else 0.0
        blocks_per_flop = (step_s - m.optimizer_s - head_s) / (m.tokens * (measured_flops_per_token
                                                                            - measured_head_flops_per_token))
        head = (head_s * tokens_per_gpu * head_flops_per_token / (m.tokens * measured_head_flops_per_token)
                if measured_head_flops_per_token else 0.0)
        blocks_flops = flops_per_token - (head_flops_per_token if measured_head_flops_per_token else 0.0)
        return blocks_per_flop * tokens_per_gpu * blocks_flops + head

    bf16 = compute_s(m.bf16_s, m.bf16_gemm_s, m.bf16_loss_s)
    fp8 = compute_s(m.fp8_s, m.fp8_gemm_s, m.fp8_loss_s)
    optimizer = m.optimizer_s * params_total / max(params_total, 1.0)
    return Workload(name=name, accelerator=m.accelerator, tokens_per_gpu=tokens_per_gpu,
                    flops_per_token=flops_per_token, layers=layers,
                    params_per_layer=(params_total - params_root) / layers, params_root=params_root,
                    fp8_gather_fraction=fp8_gather_fraction, compute_s=bf16,
                    fp8_compute_speedup=recipe_fp8_speedup or bf16 / fp8, optimizer_s=optimizer,
                    head_flops_per_token=head_flops_per_token, recompute_fraction=recompute_fraction)


# ---------------------------------------------------------------------------------------------------------------
# Published runs the model is checked against. Each case: a workload calibrated on a published bf16 figure (or a
# published bf16 MFU), then the published FP8 figure predicted from our single-GPU FP8 measurements and the
# communication model.

# Llama3-8B as torchtitan counts it: 8.03B parameters, 32 blocks of 218.1M, root 1.05B (embedding + head); FLOPs per
# token 6 * (N - embedding) + 12 * L * D * T at seq 8192, of which the output head's 6 * D * V.
_LLAMA3_8B = Workload("llama3_8b", "h100", 8192, 6 * (8.03e9 - 0.525e9) + 12 * 32 * 4096 * 8192, 32, 218.1e6, 1.051e9,
                      0.999, 1.0, 1.0, head_flops_per_token=6 * 4096 * 128256)
# Llama3-70B: 70.55B parameters, 80 blocks of 855.6M, root 2.10B; seq 8192.
_LLAMA3_70B = Workload("llama3_70b", "h100", 8192, 6 * (70.55e9 - 1.05e9) + 12 * 80 * 8192 * 8192, 80, 855.6e6,
                       2.10e9, 0.9998, 1.0, 1.0, head_flops_per_token=6 * 8192 * 128256)
# Share of the step's compute in the bf16 output head (torchtitan's float8 leaves it bf16): 6 * D * V FLOPs a token.
_HEAD_8B = _LLAMA3_8B.head_flops_per_token / _LLAMA3_8B.flops_per_token
_HEAD_70B = _LLAMA3_70B.head_flops_per_token / _LLAMA3_70B.flops_per_token
# torchtitan's published Llama3-8B FSDP runs (docs/performance.md, Tables 1 and 3) use local batch 2 at seq 8192 and
# its selective, per-op activation checkpointing. That policy (parallelize_llama.py at the commit the tables name)
# saves attention and the outputs of aten.mm except every second one, so each block's forward runs wk, wo and w3
# again. Float8 linears too: torchao's Float8Linear calls torch.mm on its float8 tensor subclass, which the policy's
# dispatch mode sees as aten.mm before the subclass turns it into a scaled mm. As a share of a block's forward FLOPs
# (linears 2 * params a token, attention 4 * D * T as torchtitan counts it):
_D, _KV, _F, _T = 4096, 1024, 14336, 8192
_SAC_8B = 2 * (_D * _KV + _D * _D + _D * _F) / (2 * (2 * _D * _D + 2 * _D * _KV + 3 * _D * _F) + 4 * _D * _T)
_TORCHTITAN_8B = dataclasses.replace(_LLAMA3_8B, tokens_per_gpu=2 * 8192)
# One Llama3-8B layer at seq 8192, fwd + bwd, torchao's recipes vs compiled bf16 (measured in this project on one
# GPU; docs/scaling.md): the tensorwise and rowwise speedups below. For a 70B layer, the same linear-GEMM speedup (what
# the 8B layer's leaves after its bf16 attention, 23.5 % of its FLOPs), scaled by the measured 70B/8B ratio of the w13
# GEMM speedups, on 13.6 % attention FLOPs.
_TENSORWISE_8B_LAYER = 1.235
_ROWWISE_8B_LAYER = 1.042
_LINEAR_8B = 0.765 / (1 / 1.235 - 0.235)
_TENSORWISE_70B_LAYER = 1.0 / (0.136 + 0.864 / (_LINEAR_8B * 1.64 / 1.55))
_BF16 = Precision(fp8=False, fp8_all_gather=False, gather_bytes=2, reduce_bytes=4)  # torchtitan's FSDP defaults
_FP8_AG = Precision(True, True, 2, 4)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    fabric: str
    world_size: int
    workload: Workload
    baseline_tokens_per_s: float  # the published bf16 figure the compute is calibrated on
    precision: Precision
    layer_speedup: float
    head_fraction: float
    published_tokens_per_s: float  # what the model must predict
    baseline_world_size: int = 0  # where the baseline was published; 0: world_size
    baseline_recompute: float = 0.0  # Workload.recompute_fraction of the baseline (bf16) run
    recompute: float = 0.0  # and of the predicted run


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("torchtitan Llama3-8B, 8x H100, float8 tensorwise + fp8 all-gather (vs bf16 compiled 6667)",
                 "torchtitan docs/performance.md Table 1: 5762 eager -> 6667 compile -> 8532 float8 tokens/s/GPU",
                 "nvlink_ib400", 8, _TORCHTITAN_8B, 6667.0, _FP8_AG, _TENSORWISE_8B_LAYER, _HEAD_8B, 8532.0,
                 baseline_recompute=_SAC_8B, recompute=_SAC_8B),
    PublishedRun("torchao Llama3-8B, 8x H100, float8 rowwise (bf16 all-gather): +10 % over bf16",
                 "torchao float8 README (torchtitan Llama3-8B, 8x H100): rowwise +10 %, tensorwise + fp8 all-gather +25 %",
                 "nvlink_ib400", 8, _LLAMA3_8B, 6667.0, Precision(True, False, 2, 4), _ROWWISE_8B_LAYER, _HEAD_8B,
                 6667.0 * 1.10),
    PublishedRun("torchao Llama3-8B, 8x H100, float8 tensorwise + fp8 all-gather: +25 % over bf16",
                 "torchao float8 README (as above)", "nvlink_ib400", 8, _LLAMA3_8B, 6667.0, _FP8_AG,
                 _TENSORWISE_8B_LAYER, _HEAD_8B, 6667.0 * 1.25),
    # The same step on 16 nodes (Table 3), predicted from the 8-GPU bf16 figure: what the communication model adds.
    PublishedRun("torchtitan Llama3-8B, 128x H100, bf16 compiled (calibrated on 8x H100: 6667)",
                 "torchtitan docs/performance.md Table 3: 5605 eager -> 6514 compile -> 8380 float8 tokens/s/GPU",
                 "nvlink_ib400", 128, _TORCHTITAN_8B, 6667.0, _BF16, 1.0, _HEAD_8B, 6514.0,
                 baseline_world_size=8, baseline_recompute=_SAC_8B, recompute=_SAC_8B),
    PublishedRun("torchtitan Llama3-8B, 128x H100, float8 tensorwise + fp8 all-gather (calibrated on 8x H100 bf16)",
                 "torchtitan docs/performance.md Table 3 (as above)", "nvlink_ib400", 128, _TORCHTITAN_8B, 6667.0,
                 _FP8_AG, _TENSORWISE_8B_LAYER, _HEAD_8B, 8380.0,
                 baseline_world_size=8, baseline_recompute=_SAC_8B, recompute=_SAC_8B),
)

# Published runs kept to show the model against them, not asserted: the post gives neither the tensor-parallel degree
# nor the batch (torchtitan's Llama3-70B config uses TP 8 and 8 sequences per rank, which this FSDP-only model cannot
# express); they are modelled as FSDP-only at one sequence per GPU over RoCE, without activation checkpointing.
UNMODELLED_RUNS: tuple[PublishedRun, ...] = (
    # The bf16 run's throughput is not published, only the ratio: calibrate on the FLOP rate of the 8-GPU bf16 run
    # (PUBLISHED_RUNS[0]) and predict the ratio.
    PublishedRun("torchtitan Llama3-70B, 128 H100s, float8 + fp8 all-gather: 1.50x over bf16",
                 "PyTorch dev-discuss 'Enabling Float8 All-Gather in FSDP2': 1.50x, 20 % of the gain from the "
                 "fp8 all-gather", "nvlink_roce400", 128, _LLAMA3_70B, 0.0, _FP8_AG,
                 _TENSORWISE_70B_LAYER, _HEAD_70B, 1.50),
    PublishedRun("torchtitan Llama3-70B, 128 H100s, float8 with a bf16 all-gather: 1.40x over bf16",
                 "the same post: 80 % of the 1.50x gain from float8 compute alone", "nvlink_roce400", 128, _LLAMA3_70B,
                 0.0, Precision(True, False, 2, 4), _TENSORWISE_70B_LAYER, _HEAD_70B, 1.40),
)


def validate_published(runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> list[dict]:
    """Predicted vs published for each run: {name, fabric, world_size, published, predicted, error} where error =
    predicted / published - 1. The compute is calibrated on the run's bf16 baseline (at its baseline_world_size,
    with its baseline_recompute), then the run predicted at world_size with its precision and recompute. Runs with
    baseline 0 are ratios (FP8 over bf16 at that scale) calibrated on the compute FLOP rate of PUBLISHED_RUNS[0]."""
    rows = []
    reference = PUBLISHED_RUNS[0]
    ref_cal = calibrate_compute(dataclasses.replace(reference.workload, recompute_fraction=reference.baseline_recompute),
                                _BF16, FABRICS[reference.fabric], reference.baseline_world_size or reference.world_size,
                                reference.baseline_tokens_per_s)
    flop_rate = ref_cal.tokens_per_gpu * ref_cal.flops_per_token / ref_cal.compute_s
    for run in runs:
        fabric = FABRICS[run.fabric]
        w = dataclasses.replace(run.workload, recompute_fraction=run.baseline_recompute)
        if run.baseline_tokens_per_s > 0:
            w = calibrate_compute(w, _BF16, fabric, run.baseline_world_size or run.world_size,
                                  run.baseline_tokens_per_s)
        else:
            w = dataclasses.replace(w, compute_s=w.tokens_per_gpu * w.flops_per_token / flop_rate)
        bf16 = predict_step(w, _BF16, fabric, run.world_size).tokens_per_s_per_gpu
        w = dataclasses.replace(w, fp8_compute_speedup=fp8_compute_speedup(run.layer_speedup, run.head_fraction),
                                recompute_fraction=run.recompute)
        tps = predict_step(w, run.precision, fabric, run.world_size).tokens_per_s_per_gpu
        predicted = tps if run.baseline_tokens_per_s > 0 else tps / bf16
        rows.append({"name": run.name, "source": run.source, "fabric": run.fabric, "world_size": run.world_size,
                     "published": run.published_tokens_per_s, "predicted": predicted,
                     "error": predicted / run.published_tokens_per_s - 1.0})
    return rows
