"""The product's training step on one GPU: bf16 vs our FP8 vs torchao, timed through the worker's own function.

    PYTHONUNBUFFERED=1 python3 benchmarks/train_step.py --out $OUT [--configs dense,moe] [--only VARIANTS]
        [--steps 10] [--warmup 4] [--budget-s S] [--eager] [--profile] [--device cuda|cpu]

Each row builds the model, optimizer and divergence guard as the worker loop does (training/model_setup.py:
build_training_model, training/optimizer.make_optimizer, divergence.guard.StepGuard, all from a JobConfig) and
times orchestration.training.step.train_step, the function the loop runs once per optimizer step: forward and
backward, gradient norm, the divergence check, the clipped AdamW update, zero_grad. So the timings include what the
product pays: float32 master weights under bf16 autocast, blocks compiled on CUDA (model.compile), optim.ChunkedAdamW
on NVIDIA (train.adamw=auto), the worker's GC policy (train.gc_every_steps). Steps run back to back, an event at
each step boundary (a host clock on CPU); the median gives tokens/s and MFU against the device's bf16 peak.

Variants ("name" or "name:recipe", recipe tensorwise | rowwise | rowwise_gw_hp, default the product's auto):
  bf16            precision=bf16, with the divergence check (the loop runs it in bf16 too)
  ours            precision=fp8 with the product's defaults
  ours_head       the same with precision.fp8_output_head=true (the LM head in FP8, its loss fused under tensorwise)
  ours_nocheck    ours with monitor.enabled=false: the step without the divergence check (monitor overhead)
  torchao         torchao.float8 on the same linears (no output head, no router), recipe tensorwise | rowwise, or
                  "moe" (torchao's FP8 grouped GEMMs on the routed experts); no divergence check
  torchao_head    torchao with the output head converted too
torchao is optional: without it its rows carry an error note and the others run.

Configurations:
- dense: Llama3-8B layers at full width (dim 4096, GQA 32/8, ffn 14336, vocab 128256), 4 of them (--dense-layers),
         seq 8192, bs 1
- moe:   DeepSeek-MoE-16B layers at full width (64 routed experts of 1408, top-6, 2 shared), 4 of them
         (--moe-layers), 16384 tokens per step (bs 4 x seq 4096)
- debug: the debug_dense flavor at seq 32, bs 2: a CPU check of this program (FP8 emulated)
Writes train_step.json to --out and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import env_info, kernel_times, write_json
from models.deepseek_moe import GroupedExperts
from orchestration.config import JobConfig, ModelConfig, MonitorConfig, PrecisionConfig, TrainConfig
from orchestration.divergence.guard import StepGuard
from orchestration.observability.kernel_profile import kernel_breakdown
from orchestration.training.compile import compile_blocks, compile_enabled
from orchestration.training.gc_policy import ManagedGc
from orchestration.training.model_setup import build_training_model
from orchestration.training.optimizer import make_optimizer
from orchestration.training.step import MicroBatch, StepModel, StepResult, train_step
from orchestration.validation import validate

logger = logging.getLogger("benchmarks.train_step")

CONFIGS = {
    # Variant order is priority order: a time budget stops starting new ones (skips are recorded). Depth as the
    # loop suites (run_suite.py): float32 master weights with AdamW cost 16 bytes a parameter, ~45 GB for 8 dense
    # layers with the embedding and head, too much beside seq-8192 activations on an 80 GB GPU.
    "dense": {"model": "llama3_8b", "overrides": {"n_layers": 4}, "batch": 1, "seq": 8192,
              "variants": ["bf16", "ours:tensorwise", "ours_head:tensorwise", "torchao:tensorwise",
                           "torchao_head:tensorwise", "ours:rowwise", "torchao:rowwise", "ours_nocheck:tensorwise"]},
    "moe": {"model": "deepseek_moe16b", "overrides": {"n_layers": 4}, "batch": 4, "seq": 4096,
            "variants": ["bf16", "ours:tensorwise", "ours_head:tensorwise", "torchao:moe",
                         "ours_nocheck:tensorwise"]},
    "debug": {"model": "debug_dense", "overrides": {}, "batch": 2, "seq": 32,
              "variants": ["bf16", "ours:tensorwise", "ours_head:tensorwise", "ours_nocheck:tensorwise",
                           "torchao:tensorwise", "torchao_head:tensorwise"]},
}

IMPLS = ("bf16", "ours", "ours_head", "ours_nocheck", "torchao", "torchao_head")
OUR_RECIPES = ("auto", "tensorwise", "rowwise", "rowwise_gw_hp")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp", "moe")


@dataclass(frozen=True)
class Variant:
    impl: str  # one of IMPLS
    recipe: str  # FP8 recipe ("" for bf16)

    @classmethod
    def parse(cls, text: str) -> Variant:
        impl, _, recipe = text.partition(":")
        if impl not in IMPLS:
            raise ValueError(f"unknown variant {text!r}: the name is one of {', '.join(IMPLS)} (optionally ':recipe')")
        if impl == "bf16":
            if recipe:
                raise ValueError(f"variant {text!r}: bf16 takes no recipe (drop ':{recipe}')")
            return cls(impl, "")
        choices = TORCHAO_RECIPES if impl.startswith("torchao") else OUR_RECIPES
        recipe = recipe or ("tensorwise" if impl.startswith("torchao") else "auto")
        if recipe not in choices:
            raise ValueError(f"variant {text!r}: recipe {recipe!r} is not one of {', '.join(choices)}")
        if impl == "torchao_head" and recipe == "moe":
            raise ValueError(f"variant {text!r}: torchao's MoE conversion covers the experts only; use torchao:moe")
        return cls(impl, recipe)

    @property
    def ours(self) -> bool:
        return self.impl.startswith("ours")

    @property
    def torchao(self) -> bool:
        return self.impl.startswith("torchao")

    @property
    def head(self) -> bool:
        return self.impl.endswith("_head")

    @property
    def checked(self) -> bool:
        """Runs the divergence check (the product's step does, in bf16 and fp8)."""
        return self.impl in ("bf16", "ours", "ours_head")


def job_for(cfg: dict, variant: Variant, eager: bool, device: torch.device) -> JobConfig:
    """The JobConfig the worker would run this row with: only the fields the variant names differ from defaults."""
    job = JobConfig(
        model=ModelConfig(name=cfg["model"], overrides=dict(cfg["overrides"]), compile=False if eager else None),
        precision=PrecisionConfig(name="fp8" if variant.ours else "bf16",
                                  recipe=variant.recipe if variant.ours else "auto",
                                  fp8_output_head=variant.ours and variant.head),
        train=TrainConfig(global_batch_size=cfg["batch"], micro_batch_size=cfg["batch"], sharding="none"),
        monitor=MonitorConfig(enabled=variant.checked),
    )
    job.cluster.device = device.type
    job.cluster.min_workers = job.cluster.max_workers = 1  # one worker with its one GPU
    job.cluster.gpus_per_worker = 1.0 if device.type == "cuda" else 0.0
    job.data.seq_len = cfg["seq"]
    validate(job)  # as the loaded config: train.lr=null takes the flavor's peak_lr, bad values fail here
    return job


# torchao's FP8 grouped GEMMs contract over the tokens in the weight gradient: torch._grouped_mm then wants every
# token group a multiple of 16 rows (16 bytes of fp8), else "expected input tensor dynamic dimension byte size to be
# non-negative multiple of 16" (device-side assert on the H100, torch 2.11, torchao 0.18). Ours needs no padding.
TORCHAO_GROUP_ALIGN = 16


def padded_rows(n_rows: int, n_groups: int, align: int) -> int:
    """Rows of the padded layout: room for every group's padding, a multiple of `align` (a fixed size: no sync)."""
    return -(-(n_rows + n_groups * (align - 1)) // align) * align


def aligned_group_rows(offs_E: torch.Tensor, n_rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row r's row in the padded layout, the padded layout's group ends) when every group of offs_E starts at a
    multiple of `align` rows and the last one ends at padded_rows (every group a multiple of `align` long, no row
    outside a group). Pure, on the device, no host sync."""
    counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    padded_E = (counts_E + align - 1) // align * align
    padded_offs_E = torch.cumsum(padded_E, 0).to(offs_E.dtype)
    starts_E = padded_offs_E - padded_E
    padded_offs_E[-1] = padded_rows(n_rows, offs_E.numel(), align)
    rows = torch.arange(n_rows, device=offs_E.device)
    group_R = torch.bucketize(rows, offs_E, right=True).clamp_(max=offs_E.numel() - 1)
    dest_R = starts_E[group_R] + rows - (offs_E - counts_E)[group_R]
    return dest_R, padded_offs_E


def pad_token_groups(experts: GroupedExperts, align: int) -> None:
    """Run this module's grouped GEMMs on token groups padded to `align` rows (zero rows between groups)."""
    forward = experts.forward

    def padded_forward(x_RD: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        dest_R, padded_offs_E = aligned_group_rows(offs_E, x_RD.shape[0], align)
        x_PD = x_RD.new_zeros(padded_rows(x_RD.shape[0], offs_E.numel(), align), x_RD.shape[1])
        x_PD = x_PD.index_copy(0, dest_R, x_RD)
        return forward(x_PD, padded_offs_E).index_select(0, dest_R)

    experts.forward = padded_forward


def convert_torchao(model: torch.nn.Module, recipe: str, output_head: bool) -> None:
    """torchao's FP8 training on the layers ours converts (16-aligned linears, no router; the head only if asked)."""
    if recipe == "moe":
        # torchao's MoE FP8 training wraps the expert weights so torch._grouped_mm dispatches to its FP8 path. Its
        # own token-group padding asserts "not yet supported" under torch.compile (0.18), so the model pads the
        # groups to 16 rows itself, as it does for ours.
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        quantize_(model, config=Float8TrainingOpConfig(pad_token_groups_for_grouped_mm=False),
                  filter_fn=lambda module, fqn: isinstance(module, GroupedExperts))
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                pad_token_groups(module, TORCHAO_GROUP_ALIGN)
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    name = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}[recipe]

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        return ((output_head or fqn != "output") and fqn.rsplit(".", 1)[-1] != "gate"
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(name), module_filter_fn=keep)


def build_step(job: JobConfig, variant: Variant, device: torch.device) -> tuple[StepModel, StepGuard | None]:
    """(StepModel, the divergence guard or None), built as the worker loop builds them."""
    torch.manual_seed(job.train.seed)
    if variant.torchao:
        compile_after = compile_enabled(job, device)
        job.model.compile = False  # torchao converts the built model; the blocks compile after it
        model, recipe = build_training_model(job, 1, device)[:2]
        convert_torchao(model, variant.recipe, output_head=variant.head)
        if compile_after:
            compile_blocks(model, job.model.compile_mode)
            if variant.head:  # compile_blocks compiles only our FP8 head; torchao's gets the same so its casts fuse
                model.output.compile(dynamic=False)
        compiled = compile_after
    else:
        model, recipe, _, compiled = build_training_model(job, 1, device)
    optimizer = make_optimizer(job, device, model.parameters())
    cuda_graphs = compiled and job.model.compile_mode == "reduce-overhead" and device.type == "cuda"
    compute_dtype = getattr(torch, job.precision.compute_dtype)
    sm = StepModel(model, optimizer, device, compute_dtype, compiled, cuda_graphs, 1, job.train.sharding,
                   job.train.grad_clip)
    if not variant.checked:
        return sm, None
    # As the loop's; no shadow losses: monitor.shadow_every is 0 by default.
    return sm, StepGuard(job.monitor, model, fp8_run=recipe is not None)


def random_batches(vocab: int, batch: int, seq: int, device: torch.device, n: int = 3) -> list[list[MicroBatch]]:
    """n steps of one micro-batch each (the whole batch on this rank: weight and share 1), tokens uniform in vocab
    from a CPU generator seeded 0."""
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append([MicroBatch(tokens[:, :-1].to(device), tokens[:, 1:].to(device), 1.0, 1.0)])
    return out


def time_steps(run_step: Callable[[int], StepResult], warmup: int, steps: int, device: torch.device
               ) -> tuple[list[float], list[StepResult]]:
    """Per-step milliseconds of `steps` back-to-back steps after `warmup`, and every step's result."""
    results = [run_step(i) for i in range(warmup)]
    if device.type != "cuda":
        times = []
        for i in range(warmup, warmup + steps):
            t0 = time.perf_counter()
            results.append(run_step(i))
            results[-1].loss.item()
            times.append((time.perf_counter() - t0) * 1e3)
        return times, results
    torch.cuda.synchronize(device)
    # Back to back, as the loop runs them: an event at each boundary and one host wait at the end (the guard's own
    # host read inside each step still drains the queue there, as in the worker).
    boundaries = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    boundaries[0].record()
    for i in range(steps):
        results.append(run_step(warmup + i))
        boundaries[i + 1].record()
    boundaries[-1].synchronize()
    return [boundaries[i].elapsed_time(boundaries[i + 1]) for i in range(steps)], results


def bench_row(name: str, cfg: dict, text: str, args: argparse.Namespace, device: torch.device, plan) -> dict:
    from orchestration.observability.mfu import compute_mfu, peak_flops_per_s

    row: dict = {"config": name, "variant": text}
    t0 = time.time()
    variant = Variant.parse(text)
    if variant.torchao:
        try:
            import torchao  # noqa: F401
        except ImportError as exc:
            row["error"] = f"skipped: torchao is not installed ({exc})"
            return row
    torch._dynamo.reset()  # fresh graphs per row: nothing compiled for one variant is reused by the next
    job = job_for(cfg, variant, args.eager, device)
    sm, guard = build_step(job, variant, device)
    batches = random_batches(sm.model.args.vocab_size, cfg["batch"], cfg["seq"], device)

    managed_gc = ManagedGc(job.train.gc_every_steps)

    def run_step(step: int) -> StepResult:
        result = train_step(sm, batches[step % len(batches)], step, guard)
        managed_gc.step(step + 1)  # as the loop: a young-generation collection when the steps taken are due
        return result

    with managed_gc:
        times, results = time_steps(run_step, args.warmup, args.steps, device)
    tokens = cfg["batch"] * cfg["seq"]
    ms = statistics.median(times)
    peak = peak_flops_per_s(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    row.update(
        impl=variant.impl, recipe=variant.recipe, divergence_check=variant.checked,
        precision="fp8" if variant.impl != "bf16" else "bf16",
        times_ms=[round(t, 3) for t in times], ms=ms, ms_min=min(times), ms_mean=statistics.mean(times),
        tokens_per_s=tokens / (ms / 1e3), mfu_bf16_peak=compute_mfu(plan.flops_per_token, tokens / (ms / 1e3), peak),
        losses=[float(r.loss) for r in results], updates_applied=sum(r.updated for r in results),
        decisions=sorted({r.decision.kind for r in results}), optimizer=type(sm.optimizer).__name__,
        compiled=sm.compiled, setup_s=round(time.time() - t0, 1),
        max_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    if args.profile and device.type == "cuda":
        step = args.warmup + args.steps
        kernels = kernel_times(lambda: run_step(step))
        row["profile"] = kernels[:args.profile_top]
        # against the median step time: a profiled step runs slower, its idle share would be inflated
        row["profile_breakdown"] = kernel_breakdown(kernels, ms)
    return row


def bench_config(name: str, cfg: dict, args: argparse.Namespace, device: torch.device, start: float,
                 save: Callable[[dict], None]) -> dict:
    from models.planning import plan_model

    plan = plan_model(cfg["model"], world_size=1, seq_len=cfg["seq"], micro_batch=cfg["batch"],
                      overrides=cfg["overrides"])
    rows = []
    result = {"config": name, "model": cfg["model"], "overrides": cfg["overrides"], "batch": cfg["batch"],
              "seq": cfg["seq"], "tokens_per_step": cfg["batch"] * cfg["seq"], "flops_per_token": plan.flops_per_token,
              "total_params": plan.total_params, "active_params": plan.active_params, "rows": rows}
    for text in (args.only.split(",") if args.only else cfg["variants"]):
        if time.time() - start > args.budget_s:
            row = {"config": name, "variant": text, "error": f"skipped: time budget of {args.budget_s:.0f} s spent"}
        else:
            try:
                row = bench_row(name, cfg, text, args, device, plan)
            except Exception as exc:  # noqa: BLE001  # record and go on: one failing variant must not lose the others
                traceback.print_exc()
                row = {"config": name, "variant": text, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(f"[{name}] {text:26s} " + (f"{row['ms']:9.2f} ms {row['tokens_per_s']:12,.0f} tok/s" if "ms" in row
                                          else row["error"][:200]), flush=True)
        save(result)  # the rows so far: a failure that kills the process (a CUDA device-side assert) keeps them
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    base = next((r for r in rows if r["variant"] == "bf16" and "ms" in r), None)
    for r in rows:
        if base is not None and "ms" in r:
            r["speedup_vs_bf16"] = base["ms"] / r["ms"]
    return result


def main(argv: list[str] | None = None) -> dict:
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--configs", default="dense,moe", help=f"comma-separated: {', '.join(CONFIGS)}")
    ap.add_argument("--only", default="", help="comma-separated variants to run, in this order (default: the config's)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new variant after this many seconds")
    ap.add_argument("--eager", action="store_true", help="model.compile=false (default: compiled on CUDA)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU time per kernel of one more step per variant, and per category (GEMMs, casts, attention, "
                         "optimizer, ..., GPU idle)")
    ap.add_argument("--profile-top", type=int, default=20)
    ap.add_argument("--dense-layers", type=int, default=CONFIGS["dense"]["overrides"]["n_layers"])
    ap.add_argument("--moe-layers", type=int, default=CONFIGS["moe"]["overrides"]["n_layers"])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu runs FP8 emulated: a correctness check of this program, not a measurement")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs {','.join(unknown)}: choose from {', '.join(CONFIGS)}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU, or pass --device cpu (emulated FP8, for checking the program)")
    try:
        for text in (args.only.split(",") if args.only else []):
            Variant.parse(text)  # a typo fails before any model is built
    except ValueError as exc:
        ap.error(f"--only: {exc}")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    CONFIGS["dense"]["overrides"]["n_layers"] = args.dense_layers
    CONFIGS["moe"]["overrides"]["n_layers"] = args.moe_layers
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": f"python3 benchmarks/train_step.py {argv_text}", "env": env_info(), "configs": []}
    path = os.path.join(args.out, "train_step.json")

    def save(partial: dict) -> None:  # the configs done and the rows so far of the one running
        write_json(path, {**result, "configs": result["configs"] + [partial]})

    for name in names:
        result["configs"].append(bench_config(name, CONFIGS[name], args, device, start, save))
        write_json(path, result)
    print("\nconfig  variant                      ms/step     tokens/s   vs bf16")
    for c in result["configs"]:
        for r in c["rows"]:
            if "ms" in r:
                print(f"{c['config']:6s}  {r['variant']:26s} {r['ms']:9.2f} {r['tokens_per_s']:12,.0f}  "
                      f"{r.get('speedup_vs_bf16', float('nan')):.3f}x")
            else:
                print(f"{c['config']:6s}  {r['variant']:26s} {r['error'][:80]}")
    return result


if __name__ == "__main__":
    main()
