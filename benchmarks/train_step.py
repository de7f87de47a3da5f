"""End-to-end training step on one GPU: bf16 vs our FP8 recipes vs torchao, with our monitors in our timings.

    PYTHONUNBUFFERED=1 python3 benchmarks/train_step.py --out $OUT [--configs dense,moe] [--loss-steps 150]

One step = forward, cross-entropy (compiled, models/loss.py), backward, grad-norm clip, divergence check (ours:
fp8 health + StepMonitor + agreement + policy, exactly what the worker loop runs), AdamW step, zero_grad. No Ray
(not on the GPU image). Both sides compiled per transformer block (torch.compile, as torchtitan does). Timed with
CUDA events at the boundaries of `--steps` back-to-back steps after warm-up (since session 17; before, each step
alone); the median per-step time gives tokens/s and MFU (model FLOPs / datasheet peak of the
precision in use). Also a short real-data run (bytes of the Python standard library) comparing the FP8 loss with
BF16's at the same step. Writes train_step.json to --out. --profile adds a torch.profiler table per variant
(GPU time by kernel category and the top kernels). Suffixes on a variant, combinable ("ours:tensorwise+kern+cg"):
"+nomix" turns inductor's mix-order reductions off; "+kern" makes our casts Triton kernels inside the compiled
blocks too (FP8_KERNELS=always; by default the rowwise casts and the fp8 transposes are kernels); "+ntk" lets
Inductor write tensorwise's fp8 transposed copies (FP8_KERNELS=no_transposes, the session-3 default); "+cg" compiles the blocks with
mode="reduce-overhead" (CUDA graphs); "+eagerloss" runs the cross-entropy eagerly (fp32 logits materialized);
"+eagergrp" / "+tracedgrp" run the FP8 grouped GEMMs in fp8.grouped's "eager" / "traced" modes (default "opaque");
"+fp8dg" runs all their grad-input GEMMs in fp8 with promoted accumulation, "+reusedg" on the forward's quantized
weights (dgrad="fp8_reuse"), "+keepdg" on them written in the grad-input layout by the forward's cast and kept
("fp8_keep"), "+align1" leaves the experts' token groups unpadded (precision.moe_token_group_align=1; default 16),
"+padgather" builds the padded group layout by one gather (models.deepseek_moe.MoE.pad_by_gather, the default since
session 20) and "+padscatter" as a zero-filled buffer the tokens are copied into (the default before),
"+fastdg" on the weights cast again (fast accumulation, "fp8_fast") and "+widthdg" in
bf16 where the width is not a multiple of 256, else so (default: fp8.grouped's dgrad="auto", fp8_reuse since session
17); "+noexp" keeps the MoE routed experts in bf16 (precision.fp8_experts=false;
the dense linears and the head stay FP8: session 18's profile put the experts' FP8 GEMM saving, ~1.5 ms a layer, level
with their casts, ~1.6 ms); "+tfwd" has the tensorwise linears write the fp8 transposed copies
their backward GEMMs read from the casts' own compiled kernels (precision.fp8_tensorwise_transposes=forward: x^T and w^T
in forward, gy^T with gy's cast) instead of transposing the saved fp8 copies in backward (87 transposes, 2.52 ms of
session 18's MoE profile); "+autogc" leaves Python's automatic garbage collection on
during the timed steps (default: the worker's policy, orchestration/training/gc_policy.py; every row records its GC pauses under "gc"); "+minw<W>" keeps linears
with K*N/(K+N) < W in bf16 (fp8.convert.min_width_module_filter); "+eagerbody" runs the grouped GEMM custom ops'
bodies eagerly (FP8_GROUPED_BODY=eager; default: compiled on CUDA); "+head" converts the LM output head too (ours:
precision.fp8_output_head, fp8.convert.make_module_filter; torchao: the same filter without its head exclusion);
"+cdt" turns on Inductor's coordinate-descent tuning of its Triton kernels' block sizes (slower compiles); "+tadam"
steps with optim.ChunkedAdamW (one Triton launch, the clip folded in) instead of torch's fused AdamW after a clip pass;
"+nofce" keeps an FP8 "+head" unfused from the loss (default: the loss fused into the tensorwise head, fp8/head.py,
as precision.fp8_head_fused_loss does); "+nogate" steps the optimizer after the guard's host read (default, as the
worker since session 18: "+tadam" launches the step gated on the device before that read,
orchestration.divergence.agreement.agree_and_decide).
Every row also times the AdamW step alone and checks the gradients' layout
(`optimizer_probe`), which localises optimizer-time differences between variants.

Configurations (ISSUE 9):
- dense: Llama3-8B layers at full width (dim 4096, GQA 32/8, ffn 14336, vocab 128256), reduced depth, seq 8192, bs 1
- moe:   DeepSeek-MoE-16B layers at full width (64 routed experts of 1408, top-6, 2 shared), reduced depth, 16384
         tokens per step (bs 4 x seq 4096)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch._dynamo

torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.accumulated_recompile_limit = 4096

from benchmarks.common import cuda_event_ms, env_info, write_json
from models.loss import head_fuses_loss, model_lm_loss
from optim import clip_and_step
from orchestration.training.distributed import global_grad_norm, local_grad_norm
from orchestration.training.gc_policy import ManagedGc

# The loss is compiled with the blocks (as the worker does); --eager turns both off.
COMPILED = True

CONFIGS = {
    # Variant order is priority order: a time budget stops starting new ones (skips are recorded).
    # Blocks compile with dynamic=False: a run that compiled the loss-parity model first (other shapes, same code
    # objects) let dynamo mark dims dynamic, and the fp8 rows came out 5-20% slower (session2/
    # train_step_dense_dynamic_shapes.json); static shapes make every row independent of what ran before.
    # "+nomix" / "+kern" / "+cg": see the module docstring.
    "dense": {"model": "llama3_8b", "overrides": {"n_layers": 8}, "batch": 1, "seq": 8192,
              "variants": ["bf16", "ours:tensorwise", "torchao:tensorwise", "ours:rowwise", "torchao:rowwise",
                           "ours:rowwise_gw_hp", "ours_nomon:tensorwise", "ours:tensorwise+kern"]},
    "moe": {"model": "deepseek_moe16b", "overrides": {"n_layers": 4}, "batch": 4, "seq": 4096,
            "variants": ["bf16", "ours:rowwise", "torchao:moe", "ours_nomon:rowwise"]},
}


def build(model_name: str, overrides: dict, variant: str, device: torch.device, compile_blocks: bool,
          dtype: torch.dtype = torch.bfloat16, compile_mode: str | None = None, min_width: float | None = None,
          output_head: bool = False, seed: int = 0, fused_head_loss: bool = True, token_group_align: int | None = None,
          fp8_experts: bool = True, tensorwise_transposes: str = "backward"):
    from models.deepseek_moe import set_forward_recompute
    from models.registry import build_model

    model = build_model(model_name, device="meta", overrides=overrides)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    set_forward_recompute(model, False)  # no activation checkpointing here, as in the worker without it
    # Throughput: bf16 parameters on every side (AdamW states in bf16 too, the same for all). Loss parity: fp32
    # master weights under bf16 autocast, as the worker loop trains.
    model.to(dtype)
    impl, _, recipe = variant.partition(":")
    if output_head and impl == "bf16":
        raise ValueError("+head runs the output head in FP8; the bf16 rows keep every linear in bf16 (drop +head)")
    if impl not in ("ours", "ours_nomon") and (not fp8_experts or tensorwise_transposes != "backward"):
        raise ValueError(f"+noexp and +tfwd are options of our conversion; {variant!r} does not use it (drop them)")
    if tensorwise_transposes != "backward" and not recipe.startswith("tensorwise"):
        raise ValueError(f"+tfwd moves the tensorwise recipe's transposes; {variant!r} is not tensorwise (drop it)")
    if impl in ("ours", "ours_nomon"):
        import fp8

        module_filter = fp8.convert.make_module_filter(min_gemm_width=min_width or 0.0, output_head=output_head,
                                                       experts=fp8_experts)
        fp8.convert_to_fp8(model, recipe, module_filter=module_filter,
                           moe_token_group_align=token_group_align or fp8.convert.FP8_TOKEN_GROUP_ALIGN,
                           tensorwise_transposes=tensorwise_transposes)
        if output_head:  # precision.fp8_head_fused_loss (fp8/head.py); applies under the tensorwise recipe
            model.output.fused_loss = fused_head_loss
    elif impl == "torchao":
        convert_torchao(model, recipe, output_head=output_head)
    if compile_blocks:
        for block in model.layers.values():
            block.compile(dynamic=False, mode=compile_mode)  # static shapes: see the note on CONFIGS
        if output_head and not head_fuses_loss(model.output):
            # an FP8 head compiles too (its casts fuse), as orchestration.training.loop.compile_blocks does; one that fuses
            # the loss runs its own kernels
            model.output.compile(dynamic=False, mode=compile_mode)
    return model


def convert_torchao(model, recipe: str, output_head: bool = False) -> None:
    if recipe == "moe":
        # torchao's MoE FP8 training: wraps expert weights so torch._grouped_mm dispatches to its FP8 path.
        # torchao 0.18: Float8TrainingOpConfig (prototype.moe_training.config), applied with quantize_.
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        def only_experts(module, fqn):
            return fqn.endswith("experts")

        # Its padding option asserts "not yet supported" under torch.compile (0.18), so the model pads the token
        # groups to 16 rows itself, as it does for ours.
        quantize_(model, config=Float8TrainingOpConfig(pad_token_groups_for_grouped_mm=False),
                  filter_fn=only_experts)
        for module in model.modules():
            if hasattr(module, "token_group_align"):
                module.token_group_align = 16
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    name = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}[recipe]
    config = Float8LinearConfig.from_recipe_name(name)

    def keep(module, fqn):  # same filter as ours: no output head (unless output_head), no router, 16-aligned dims
        return (output_head or "output" not in fqn) and "gate" != fqn.rsplit(".", 1)[-1] and \
            module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=keep)


class Guard:
    """The worker loop's divergence check, world size 1 (agree() is the identity plus its one host read)."""

    def __init__(self, fp8_model: bool):
        from orchestration.config import MonitorConfig
        from orchestration.divergence.monitor import StepMonitor
        from orchestration.divergence.policy import DivergencePolicy

        self.fp8_model = fp8_model
        self.monitor = StepMonitor(MonitorConfig())
        self.policy = DivergencePolicy(MonitorConfig(), precision="fp8" if fp8_model else "bf16")

    def check(self, model, loss, grad_norm, step, gated_update=None):
        """-> (decision, whether gated_update applied the step's update): orchestration.divergence.agreement.agree_and_decide,
        as the worker's StepGuard calls it."""
        from orchestration.divergence.agreement import agree_and_decide

        health = None
        if self.fp8_model:
            import fp8

            health = fp8.fp8_health(model)
        verdict = self.monitor.local_verdict(loss, grad_norm, health)
        decision, _, applied = agree_and_decide(self.monitor, self.policy, verdict, step, gated_update=gated_update)
        return decision, applied


# record_function labels of the step's phases: host_profile attributes GPU idle time to the phase whose host code
# was running when the GPU ran dry.
STEP_PHASES = ("step.forward", "step.backward", "step.clip", "step.guard", "step.optimizer")


def make_step(model, optimizer, guard: Guard | None, compiled_loss: bool, cuda_graphs: bool = False,
              gated: bool = True):
    from torch.profiler import record_function

    state = {"step": 0}
    update_router_bias = getattr(model, "update_load_balance_bias", None)

    def step(inputs, targets):
        if cuda_graphs:
            # A new iteration for CUDA-graph trees, as the worker marks it (orchestration/training/loop.py).
            torch.compiler.cudagraph_mark_step_begin()
        with record_function("step.forward"):
            loss = model_lm_loss(model, inputs, targets, compiled=compiled_loss) + model.aux_loss()
        with record_function("step.backward"):
            loss.backward()
        with record_function("step.clip"):
            # As the worker (Trainer._run_steps): one pass for the norm here, the clip with it after the guard.
            grad_norm = global_grad_norm(local_grad_norm(model, inputs.device), world_size=1, sharding="fsdp")

        router_done = False

        def gated_update(gate):
            # As the worker's Trainer.gated_update, launched before the guard's host read (so under the step.guard
            # label in host profiles): the router's bias update (aux-loss-free balancing), then our AdamW ("+tadam"),
            # which scales in its launch and takes the gate; torch's AdamW cannot (False: stepped after the read).
            nonlocal router_done
            if update_router_bias is not None:
                update_router_bias(gate=gate)
            router_done = True
            return clip_and_step(optimizer, model.parameters(), grad_norm, 1.0, gate)

        applies_update, applied = True, False
        if guard is not None:
            with record_function("step.guard"):
                decision, applied = guard.check(model, loss.detach(), grad_norm, state["step"],
                                                gated_update=gated_update if gated else None)
                applies_update = decision.applies_update
        with record_function("step.optimizer"):
            if applies_update:
                if not applied:
                    clip_and_step(optimizer, model.parameters(), grad_norm, 1.0)
                if not router_done and update_router_bias is not None:  # the worker's per-kept-step MoE balancing
                    update_router_bias()
            optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        return loss.detach()

    return step


class GcTimer:
    """Python garbage-collector pauses (gc.callbacks) while active: count and total ms per generation."""

    def __init__(self):
        self.ms_by_gen: dict[int, float] = {}
        self.count = 0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            gen = info.get("generation", -1)
            self.ms_by_gen[gen] = self.ms_by_gen.get(gen, 0.0) + (time.perf_counter() - self._t0) * 1e3
            self.count += 1

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def summary(self, steps: int) -> dict:
        total = sum(self.ms_by_gen.values())
        return {"collections": self.count, "ms_total": round(total, 2), "ms_per_step": round(total / max(1, steps), 2),
                "ms_by_generation": {str(g): round(ms, 2) for g, ms in sorted(self.ms_by_gen.items())}}


def time_optimizer_step(optimizer, reps: int = 5) -> float:
    """optimizer.step() alone on the current gradients: median ms of `reps` (CUDA events)."""
    return cuda_event_ms(optimizer.step, reps)


def optimizer_probe(model, optimizer, batch, compiled_loss: bool, reps: int = 5) -> dict:
    """AdamW step alone (ms, median of `reps`) after one forward/backward, and the layout of the gradients it reads.

    The fused AdamW kernel reads each gradient as a flat array; a gradient that is not dense in the parameter's
    layout, or is misaligned for vector loads, would slow it down without showing up anywhere else.
    """
    inputs, targets = batch
    loss = model_lm_loss(model, inputs, targets, compiled=compiled_loss) + model.aux_loss()
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    layout = {
        "params_with_grad": len(params),
        "numel": sum(p.numel() for p in params),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in params}),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "grad_stride_differs": [n for n, p in model.named_parameters() if p.grad is not None
                                and p.grad.stride() != p.stride()][:10],
        "grad_not_contiguous": sum(not p.grad.is_contiguous() for p in params),
        "grad_misaligned_16B": sum(p.grad.data_ptr() % 16 != 0 for p in params),
        "param_misaligned_16B": sum(p.data_ptr() % 16 != 0 for p in params),
        "grad_storage_larger": sum(p.grad.untyped_storage().nbytes() > p.grad.numel() * p.grad.element_size()
                                   for p in params),
        # Validity: the fraction of exactly-zero gradient entries of all parameters and of the routed experts'
        # weights (a compiled FP8 MoE step once trained no expert at all: every one of these was 1.0).
        "zero_grad_frac": sum((p.grad == 0).sum().item() for p in params) / max(1, sum(p.numel() for p in params)),
        "zero_grad_frac_experts": {n: round((p.grad == 0).float().mean().item(), 4)
                                   for n, p in model.named_parameters() if "experts.w" in n and p.grad is not None},
    }
    layout["adamw_step_ms"] = time_optimizer_step(optimizer, reps)
    optimizer.zero_grad(set_to_none=True)
    print(f"      optimizer probe: {layout}", flush=True)
    return layout


def time_steps(step, batches, warmup: int, steps: int, gc_timer: GcTimer | None = None) -> list[float]:
    for i in range(warmup):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    # Steps back to back, as a training loop runs them: an event at each step boundary and one host wait at the end.
    # (Until session 17 every step was timed alone, the host waiting for its end before launching the next: the GPU
    # then idled at each step's start while the host launched its first kernels, ~3 ms a step on both sides, which a
    # loop does not pay: the next forward is launched while the optimizer runs.) The guard's host read of the
    # verdict inside each step still drains the queue there, as in the worker.
    boundaries = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    with gc_timer or contextlib.nullcontext():
        boundaries[0].record()
        for i in range(steps):
            step(*batches[i % len(batches)])
            boundaries[i + 1].record()
        boundaries[-1].synchronize()
    return [boundaries[i].elapsed_time(boundaries[i + 1]) for i in range(steps)]


# Kernel-name patterns -> category, first match wins (cuBLASLt/CUTLASS GEMMs have many spellings).
_KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attn", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "wgmma", "grouped_mm", "cublas")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    # fp8/kernels' Triton kernels (their names do not say "triton"; all end in "_kernel" with a leading "_").
    ("fp8 cast kernels (ours)", ("_amax_kernel", "_cast_tensorwise_kernel", "_rowwise_kernel", "_row_col_",
                                 "_transpose_kernel", "_batched_col_", "_jagged_")),
    ("triton (fused elementwise, casts, norms)", ("triton",)),
    ("other", ("",)),
)


def kernel_profile(step, batch, top: int = 15) -> dict:
    """GPU time by kernel over one step (torch.profiler): top kernels and per-category totals."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(*batch)
        torch.cuda.synchronize()
    busy_ms, span_ms = gpu_busy(prof)
    print(f"      GPU busy {busy_ms:.2f} ms of a {span_ms:.2f} ms kernel span (idle {span_ms - busy_ms:.2f} ms)",
          flush=True)
    kernels = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and not ev.key.startswith("ProfilerStep"):
            kernels.append({"kernel": ev.key[:110], "ms": t / 1e3, "calls": ev.count})
    kernels.sort(key=lambda r: -r["ms"])
    categories: dict[str, float] = {}
    for k in kernels:
        name = k["kernel"].lower()
        cat = next(c for c, pats in _KERNEL_CATEGORIES if any(p in name for p in pats))
        k["category"] = cat
        categories[cat] = categories.get(cat, 0.0) + k["ms"]
    for cat, ms in sorted(categories.items(), key=lambda kv: -kv[1]):
        print(f"      {ms:9.2f} ms  {cat}", flush=True)
    for k in kernels[:top]:
        print(f"      {k['ms']:9.2f} ms {k['calls']:5d}x  {k['kernel'][:100]}", flush=True)
    # "other" is whatever no pattern names (eager torch kernels: copies, fills, index ops): list it separately,
    # it is where unplanned work shows up.
    top_other = [k for k in kernels if k["category"] == "other"][:top]
    for k in top_other:
        print(f"      other {k['ms']:9.2f} ms {k['calls']:5d}x  {k['kernel'][:100]}", flush=True)
    return {"categories_ms": categories, "top_kernels": kernels[:top], "top_other_kernels": top_other,
            "gpu_busy_ms": busy_ms, "kernel_span_ms": span_ms}


def _kernel_gaps(kernels: list[tuple[float, float, str]]) -> tuple[list[tuple[float, float, str, str]], float]:
    """GPU idle gaps of a start-sorted kernel timeline [(start, end, name)]: ([(gap_start, gap_end, kernel before,
    kernel after)], latest kernel end). A gap starts when every kernel launched so far has finished."""
    gaps = []
    cur_end, cur_name = kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > cur_end:
            gaps.append((cur_end, start, cur_name, name))
        if end > cur_end:
            cur_end, cur_name = end, name
    return gaps, cur_end


def gpu_busy(prof) -> tuple[float, float]:
    """(time some kernel was running, first kernel start to last kernel end), ms: their difference is the time the
    GPU waited for the host (launch overhead, host syncs) inside the profiled step."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not kernels:
        return 0.0, 0.0
    gaps, last_end = _kernel_gaps(kernels)
    busy = last_end - kernels[0][0] - sum(end - start for start, end, _, _ in gaps)
    return busy / 1e3, (kernels[-1][1] - kernels[0][0]) / 1e3


_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMalloc",
               "cudaFree", "cudaHostAlloc")


def _cpu_context(cpu_events, t_us: float, gap_start: float) -> dict:
    """What the host was doing at time t (innermost op running, with two parents) and the longest op that
    started inside the gap [gap_start, t]."""
    running = [e for e in cpu_events if e.time_range.start <= t_us <= e.time_range.end]
    inner = max(running, key=lambda e: e.time_range.start, default=None)
    chain = []
    ev = inner
    while ev is not None and len(chain) < 3:
        chain.append(ev.name[:60])
        ev = ev.cpu_parent
    inside = [e for e in cpu_events if gap_start <= e.time_range.start <= t_us]
    longest = max(inside, key=lambda e: e.time_range.end - e.time_range.start, default=None)
    return {"host_at_gap_end": chain,
            "longest_host_op_in_gap": None if longest is None else
            [longest.name[:60], round((longest.time_range.end - longest.time_range.start) / 1e3, 3)]}


def sync_probe(step, batch) -> list[dict]:
    """The host-synchronising calls of one step and where they come from: the step runs under
    torch.cuda.set_sync_debug_mode("warn"), and each warning's Python stack (the last frames inside this repository)
    is recorded once. The guard's one read is expected; anything else makes the GPU idle while the host waits."""
    import traceback
    import warnings

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen: dict[tuple, dict] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(repo)][-4:]
        key = tuple((f.filename, f.lineno) for f in frames)
        entry = seen.setdefault(key, {"count": 0, "message": str(message)[:120],
                                      "stack": [f"{os.path.relpath(f.filename, repo)}:{f.lineno} {f.name}"
                                                for f in frames]})
        entry["count"] += 1

    torch.cuda.synchronize()
    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(*batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    torch.cuda.synchronize()
    out = list(seen.values())
    for entry in out:
        print(f"      sync x{entry['count']}: {entry['message']} <- {' <- '.join(reversed(entry['stack']))}", flush=True)
    return out


def host_profile(step, batches, steps: int = 6, top: int = 12) -> dict:
    """Where the host time of `steps` steps goes and which host code the GPU waited for.

    torch.profiler with CPU activity (which slows the host a little): per phase (STEP_PHASES) its host wall time
    and the GPU idle that ended while it ran - a gap in the kernel timeline ends when the host launches the next
    kernel, so the host code running then is what the GPU waited for; the largest gaps with the host op running
    at their end and the longest host op inside them; the host syncs and allocations; the ops with the most
    self CPU time. Several steps, because the idle of the FP8 MoE step comes and goes between steps.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    events = prof.events()
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    phases = sorted((e.time_range.start, e.time_range.end, e.name) for e in cpu_events if e.name in STEP_PHASES)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    idle_by_phase: dict[str, float] = {}
    gaps = []
    for gap_start, gap_end, before, after in (_kernel_gaps(kernels)[0] if kernels else []):
        where = next((ph for s, e, ph in phases if s <= gap_end <= e), "between phases")
        idle_by_phase[where] = idle_by_phase.get(where, 0.0) + (gap_end - gap_start) / 1e3
        gaps.append((gap_end - gap_start, gap_start, gap_end, where, before, after))
    gaps.sort(reverse=True)
    top_gaps = [{"ms": round(g / 1e3, 3), "phase": where, "kernel_before": before[:60], "kernel_after": after[:60],
                 **_cpu_context(cpu_events, gap_end, gap_start)}
                for g, gap_start, gap_end, where, before, after in gaps[:8]]
    host_ms_by_phase: dict[str, float] = {}
    for s, e, name in phases:
        host_ms_by_phase[name] = host_ms_by_phase.get(name, 0.0) + (e - s) / 1e3 / steps
    syncs: dict[str, int] = {}
    for e in cpu_events:
        if any(e.name.startswith(c) for c in _SYNC_CALLS):
            syncs[e.name] = syncs.get(e.name, 0) + 1
    averages = [a for a in prof.key_averages() if a.self_cpu_time_total > 0]
    averages.sort(key=lambda a: -a.self_cpu_time_total)
    top_cpu = [{"op": a.key[:100], "self_ms_per_step": round(a.self_cpu_time_total / 1e3 / steps, 3),
                "calls_per_step": a.count / steps} for a in averages[:top]]
    ours = [{"op": a.key[:100], "cpu_ms_total_per_step": round(a.cpu_time_total / 1e3 / steps, 3),
             "calls_per_step": a.count / steps}
            for a in prof.key_averages() if "elastic_fp8" in a.key]
    out = {"steps": steps, "host_ms_by_phase_per_step": {k: round(v, 2) for k, v in host_ms_by_phase.items()},
           "gpu_idle_ms_by_phase_total": {k: round(v, 2) for k, v in sorted(idle_by_phase.items(),
                                                                             key=lambda kv: -kv[1])},
           "top_gaps": top_gaps, "host_syncs_and_allocs": syncs, "top_self_cpu": top_cpu, "fp8_ops_cpu": ours}
    print(f"      host ms per step by phase {out['host_ms_by_phase_per_step']}", flush=True)
    print(f"      GPU idle ms by phase over {steps} steps {out['gpu_idle_ms_by_phase_total']}", flush=True)
    print(f"      host syncs/allocs over {steps} steps {syncs}", flush=True)
    for g in top_gaps:
        print(f"      gap {g}", flush=True)
    for r in top_cpu:
        print(f"      cpu {r['self_ms_per_step']:8.3f} ms/step {r['calls_per_step']:7.1f}x  {r['op']}", flush=True)
    for r in ours:
        print(f"      fp8 op cpu {r['cpu_ms_total_per_step']:8.3f} ms/step {r['calls_per_step']:5.1f}x  {r['op']}",
              flush=True)
    return out


def random_batches(vocab: int, batch: int, seq: int, device, n: int = 3):
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def bench_config(name: str, cfg: dict, args, device) -> dict:
    from models.planning import plan_model
    from orchestration.observability.mfu import compute_mfu, peak_flops_per_s

    plan = plan_model(cfg["model"], world_size=1, seq_len=cfg["seq"], micro_batch=cfg["batch"],
                      overrides=cfg["overrides"])
    tokens = cfg["batch"] * cfg["seq"]
    rows = []
    # --only names the variants to run, in its order (any variant string, flags included).
    for variant in (args.only.split(",") if args.only else cfg["variants"]):
        row = {"config": name, "variant": variant}
        if time.time() - START > args.budget_s:
            row["error"] = f"skipped: time budget of {args.budget_s:.0f} s spent"
            rows.append(row)
            continue
        t0 = time.time()
        try:
            torch.manual_seed(0)
            import torch._inductor.config as inductor_config

            base_variant, *flags = variant.split("+")
            known = {"nomix", "kern", "ntk", "cg", "eagerloss", "eagergrp", "tracedgrp", "fp8dg", "widthdg", "autogc", "eagerbody", "head",
                     "cdt", "tadam", "nofce", "reusedg", "keepdg", "fastdg", "nogate", "align1", "padgather", "padscatter",
                     "noexp", "tfwd"}
            width_flags = [f for f in flags if f.startswith("minw") and f[4:].isdigit()]
            unknown = set(flags) - known - set(width_flags)
            if unknown:
                raise ValueError(f"unknown variant suffix {sorted(unknown)} in {variant!r}: {sorted(known)}")
            os.environ["FP8_GROUPED_MODE"] = ("eager" if "eagergrp" in flags else "traced" if "tracedgrp" in flags
                                              else "opaque")
            os.environ["FP8_GROUPED_DGRAD"] = ("fp8" if "fp8dg" in flags else "width" if "widthdg" in flags
                                               else "fp8_reuse" if "reusedg" in flags
                                               else "fp8_keep" if "keepdg" in flags
                                               else "fp8_fast" if "fastdg" in flags else "auto")
            os.environ["FP8_GROUPED_BODY"] = "eager" if "eagerbody" in flags else "compiled"
            # As the worker's compile_blocks: CUDA graphs need eager op bodies (fp8.grouped.set_body_mode).
            import fp8.grouped

            fp8.grouped.set_body_mode("eager" if "cg" in flags else None)
            inductor_config.triton.mix_order_reduction = "nomix" not in flags
            inductor_config.coordinate_descent_tuning = "cdt" in flags
            os.environ["FP8_KERNELS"] = "always" if "kern" in flags else "no_transposes" if "ntk" in flags else "1"
            torch._dynamo.reset()  # fresh graphs per variant: the flags above are not part of dynamo's guards
            model = build(cfg["model"], cfg["overrides"], base_variant, device, compile_blocks=not args.eager,
                          compile_mode="reduce-overhead" if "cg" in flags else None,
                          min_width=float(width_flags[0][4:]) if width_flags else None, output_head="head" in flags,
                          fused_head_loss="nofce" not in flags, token_group_align=1 if "align1" in flags else None,
                          fp8_experts="noexp" not in flags,
                          tensorwise_transposes="forward" if "tfwd" in flags else "backward")
            for module in model.modules():
                if hasattr(module, "pad_by_gather"):
                    module.pad_by_gather = "padscatter" not in flags
            vocab = model.args.vocab_size
            if "tadam" in flags:
                from optim import ChunkedAdamW

                optimizer = ChunkedAdamW(model.parameters(), lr=1e-5, fused=True)
            else:
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            impl = base_variant.split(":")[0]
            guard = Guard(fp8_model=impl == "ours") if impl == "ours" else None
            compiled_loss = COMPILED and "eagerloss" not in flags
            step = make_step(model, optimizer, guard, compiled_loss, cuda_graphs="cg" in flags,
                             gated="nogate" not in flags)
            batches = random_batches(vocab, cfg["batch"], cfg["seq"], device)
            gc_timer = GcTimer()
            # The worker's GC policy (orchestration/training/gc_policy.py, train.gc_every_steps): automatic collection off
            # while training, a young-generation collection every N steps (none inside the few timed steps).
            # "+autogc" keeps Python's automatic GC (every row before session 6).
            with contextlib.nullcontext() if "autogc" in flags else ManagedGc(every_steps=50):
                times = time_steps(step, batches, args.warmup, args.steps, gc_timer)
            row["gc"] = gc_timer.summary(args.steps)
            row["times_ms"] = [round(t, 2) for t in times]
            ms = statistics.median(times)
            precision = "bf16" if impl == "bf16" else "fp8"
            peak = peak_flops_per_s(torch.cuda.get_device_name(device), "bf16")
            row.update(ms=ms, ms_min=min(times), ms_mean=statistics.mean(times), tokens_per_s=tokens / (ms / 1e3),
                       mfu_bf16_peak=compute_mfu(plan.flops_per_token, tokens / (ms / 1e3), peak),
                       precision=precision, max_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                       setup_s=round(time.time() - t0, 1))
            row["optimizer_probe"] = optimizer_probe(model, optimizer, batches[0], compiled_loss)
            # Steps optim.ChunkedAdamW ran through its kernel (None: torch's AdamW): a "+tadam" row that fell back
            # to torch's step would show 0 here.
            row["adamw_kernel_steps"] = getattr(optimizer, "kernel_steps", None)
            if args.profile:
                print(f"[{name}] {variant} profile of one step:", flush=True)
                row["profile"] = kernel_profile(step, batches[0], top=args.profile_top)
            if args.host_profile:
                print(f"[{name}] {variant} host profile of 6 steps:", flush=True)
                row["host_profile"] = host_profile(step, batches)
            if args.sync_probe:
                print(f"[{name}] {variant} host syncs of one step:", flush=True)
                row["syncs"] = sync_probe(step, batches[0])
        except Exception as exc:  # noqa: BLE001  # record and go on: one failing variant must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        rows.append(row)
        print(f"[{name}] {variant:24s} " + (f"{row['ms']:8.2f} ms  {row['tokens_per_s']:10,.0f} tok/s"
                                             if "ms" in row else row["error"][:200]), flush=True)
        model = optimizer = step = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # Each row's baseline: the bf16 row with the same optimizer ("+tadam" or not), else the plain bf16 row, else the
    # first bf16 row; speedup_base names it.
    bf16_rows = [r for r in rows if r["variant"].split("+")[0] == "bf16" and "ms" in r]

    def uses_tadam(row: dict) -> bool:
        return "tadam" in row["variant"].split("+")[1:]

    for r in rows:
        same_optimizer = [b for b in bf16_rows if uses_tadam(b) == uses_tadam(r)]
        base = (same_optimizer[0] if same_optimizer
                else next((b for b in bf16_rows if b["variant"] == "bf16"), bf16_rows[0] if bf16_rows else None))
        if base and "ms" in r:
            r["speedup_vs_bf16"] = base["ms"] / r["ms"]
            r["speedup_base"] = base["variant"]
    return {"config": name, "model": cfg["model"], "overrides": cfg["overrides"], "batch": cfg["batch"],
            "seq": cfg["seq"], "tokens_per_step": tokens, "flops_per_token": plan.flops_per_token,
            "total_params": plan.total_params, "active_params": plan.active_params, "rows": rows}


def loss_parity(args, device) -> dict:
    """Short real-data run: FP8 loss vs BF16 loss at the same steps (same init, same data order)."""
    from orchestration.data.byte_stream import ByteTextDataset, collect_text_files, python_stdlib_dir

    files = collect_text_files(python_stdlib_dir(), "*.py", 400)
    seq, batch = 1024, 8
    # "pairs": each token is two bytes (vocab 65536), a large-vocabulary head with a skewed (Zipf-like) token
    # distribution like a real tokenizer's, for the +head rows; "bytes": vocab 256.
    pairs = args.loss_vocab == "pairs"
    data = ByteTextDataset(files, 2 * seq + 1 if pairs else seq, seed=1234)
    vocab = 65536 if pairs else 256
    overrides = {"n_layers": 4, "vocab_size": vocab, "max_seq_len": seq}
    curves = {}
    variants = args.loss_variants.split(",")
    if variants[0] != "bf16":
        raise ValueError("--loss-variants must start with bf16 (the reference)")
    for variant in variants:
        base_variant, *flags = variant.split("+")
        # "+seed<N>": another initialisation (same data order): a second bf16 row this way measures how far two
        # bf16 runs drift apart, the yardstick for the FP8 rows' differences.
        seeds = [int(f[4:]) for f in flags if f.startswith("seed") and f[4:].isdigit()]
        if set(flags) - {"head", "nofce"} - {f"seed{n}" for n in seeds}:
            raise ValueError(f"loss-parity variants take only the +head, +nofce and +seed<N> suffixes, got {variant!r}")
        seed = seeds[0] if seeds else 0
        torch.manual_seed(seed)
        model = build("llama3_1b", overrides, base_variant, device, compile_blocks=not args.eager,
                      dtype=torch.float32, output_head="head" in flags, seed=seed, fused_head_loss="nofce" not in flags)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                      fused=True)
        warm = 20
        sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s, warm=warm: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.loss_steps))))
        losses = []
        for s in range(args.loss_steps):
            inputs, targets = data.batch(s * batch, (s + 1) * batch)
            if pairs:  # bytes b0 b1 b2 ... -> tokens b0*256+b1, b2*256+b3, ...; targets are the next pair
                rows = torch.cat([inputs, targets[:, -1:]], dim=1)
                tokens = rows[:, 0::2] * 256 + rows[:, 1::2]
                inputs, targets = tokens[:, :-1], tokens[:, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model_lm_loss(model, inputs.to(device), targets.to(device), compiled=COMPILED)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves[variant] = losses
        print(f"[loss] {variant:18s} first {losses[0]:.4f} last10 {statistics.mean(losses[-10:]):.4f}", flush=True)
        model = optimizer = None
        gc.collect()
        torch.cuda.empty_cache()
    ref = statistics.mean(curves["bf16"][-10:])
    summary = {v: {"last10_mean": statistics.mean(c[-10:]),
                   "rel_diff_vs_bf16": (statistics.mean(c[-10:]) - ref) / ref} for v, c in curves.items()}
    return {"steps": args.loss_steps, "seq": seq, "batch": batch,
            "model": f"llama3_1b shape, 4 layers, vocab {vocab} ({args.loss_vocab})",
            "summary": summary, "curves": curves}


START = time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--configs", default="dense,loss,moe", help="dense, moe and loss (the loss-parity run)")
    ap.add_argument("--only", default="", help="comma-separated variants to run, in this order (default: the config's)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--loss-steps", type=int, default=150)
    ap.add_argument("--loss-variants", default="bf16,ours:tensorwise", help="loss-parity rows; bf16 first")
    ap.add_argument("--loss-vocab", choices=("bytes", "pairs"), default="bytes",
                    help="loss-parity tokens: bytes (vocab 256) or byte pairs (vocab 65536)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--profile", action="store_true", help="torch.profiler kernel table of one step per variant")
    ap.add_argument("--profile-top", type=int, default=15, help="how many kernels --profile lists")
    ap.add_argument("--host-profile", action="store_true",
                    help="per variant: host time by step phase, GPU idle attributed to phases, top CPU ops")
    ap.add_argument("--sync-probe", action="store_true",
                    help="per variant: the host-synchronising calls of one step and their Python stacks")
    ap.add_argument("--dense-layers", type=int, default=CONFIGS["dense"]["overrides"]["n_layers"],
                    help="depth of the dense config (full-width Llama3-8B layers)")
    ap.add_argument("--moe-layers", type=int, default=CONFIGS["moe"]["overrides"]["n_layers"])
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new variant after this many seconds")
    ap.add_argument("--ce-config", default="", help="a ce_head.json: use its fastest fused-head loss kernel tiles")
    args = ap.parse_args()
    global COMPILED
    COMPILED = not args.eager
    assert torch.cuda.is_available(), "benchmarks/train_step.py needs a CUDA GPU"
    device = torch.device("cuda", 0)
    CONFIGS["dense"]["overrides"]["n_layers"] = args.dense_layers
    CONFIGS["moe"]["overrides"]["n_layers"] = args.moe_layers
    result = {"command": "python3 " + " ".join(sys.argv), "env": env_info(), "configs": []}
    if args.ce_config:
        from benchmarks.ce_head import apply_best

        result["ce_config"] = apply_best(args.ce_config)
        print("fused-head loss kernels:", result["ce_config"], flush=True)
    for name in args.configs.split(","):
        if name == "loss":
            if args.loss_steps > 0 and time.time() - START < args.budget_s:
                result["loss_parity"] = loss_parity(args, device)
        elif name:
            result["configs"].append(bench_config(name, CONFIGS[name], args, device))
        write_json(os.path.join(args.out, "train_step.json"), result)
    print("\nconfig  variant                  ms/step   tokens/s   vs bf16")
    for c in result["configs"]:
        for r in c["rows"]:
            if "ms" in r:
                print(f"{c['config']:6s}  {r['variant']:24s} {r['ms']:8.2f} {r['tokens_per_s']:10,.0f}  "
                      f"{r.get('speedup_vs_bf16', float('nan')):.3f}x")
            else:
                print(f"{c['config']:6s}  {r['variant']:24s} ERROR {r['error'][:80]}")
    if "loss_parity" in result:
        for v, s in result["loss_parity"]["summary"].items():
            print(f"loss  {v:18s} last10 {s['last10_mean']:.4f}  rel diff vs bf16 {s['rel_diff_vs_bf16']:+.4%}")


if __name__ == "__main__":
    main()
