"""Dense FP8 linear benchmark: bf16 vs ours (fp8/) vs torchao, fwd+bwd, Llama3 shapes.

    PYTHONUNBUFFERED=1 python3 benchmarks/fp8_linear.py --out $OUT [--budget-s 300] [--prewarm 12]

Per shape (M = 8192 tokens, K -> N) and recipe it times one forward + backward (grad input and grad weight)
of: bf16 nn.Linear compiled; ours eager (quantization through fp8/kernels Triton kernels when present) and
ours compiled (whole layer through torch.compile/inductor); torchao 0.18 Float8Linear compiled. It also
checks numerics (SQNR vs a float64 reference); the casts alone are fp8_kernels.py's.
Compilation is the slow part on a fresh machine: `--prewarm N` first compiles every case in N parallel
processes to fill the inductor caches, then one process times every case in sequence.
Writes benchmarks/results-style JSON (fp8_linear.json) to --out.

Legend: M tokens, K in_features, N out_features.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch._dynamo
from torch import nn

# Every shape and recipe is a new compiled module of the same classes: without this, dynamo's default of
# 8 recompiles per code object silently falls back to eager after the 8th case (seen on the first run).
torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.accumulated_recompile_limit = 4096

from benchmarks.common import Budget, bench_ms, env_info, kernel_times, run_workers, sqnr_db, write_json

SHAPES = {  # name: (K, N); priority order (the targets' shapes first)
    "llama3_8b.w13": (4096, 28672),
    "llama3_70b.w13": (8192, 57344),
    "llama3_8b.w2": (14336, 4096),
    "llama3_8b.wqkv": (4096, 6144),
    "llama3_8b.wo": (4096, 4096),
    # The smaller linears of the two end-to-end models, for the size rule of fp8.convert's "auto" filter
    # (time the DeepSeek ones with --m 16384, its tokens per step).
    "llama3_8b.wk": (4096, 1024),
    "ds16b.attn": (2048, 2048),
    "ds16b.shared_w13": (2048, 2816),
    "ds16b.shared_w2": (2816, 2048),
    "ds16b.dense_w13": (2048, 10944),
    "ds16b.dense_w2": (10944, 2048),
}
OUR_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")
AO_RECIPE = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}


IMPLS = ("bf16", "torchao", "ours_eager", "ours_compiled")


def cases(shapes: list[str], impls=IMPLS, recipes=OUR_RECIPES) -> list[tuple[str, str, str]]:
    """(shape, impl, recipe) in timing order; impl in bf16 | ours_eager | ours_compiled | torchao."""
    out = []
    for s in shapes:
        if "bf16" in impls:
            out.append((s, "bf16", "-"))
        for r in recipes:
            out += [(s, i, r) for i in ("torchao", "ours_eager", "ours_compiled") if i in impls]
    return out


def build(impl: str, recipe: str, k: int, n: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    if impl == "bf16":
        return torch.compile(lin)
    if impl.startswith("ours"):
        from fp8 import Float8Linear

        mod = Float8Linear.from_float(lin, recipe)
        return torch.compile(mod) if impl == "ours_compiled" else mod
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    seq = nn.Sequential(lin)
    convert_to_float8_training(seq, config=Float8LinearConfig.from_recipe_name(AO_RECIPE[recipe]))
    return torch.compile(seq)


def make_step(mod: nn.Module, m: int, k: int, n: int, device: str):
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    gy = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g)
    params = list(mod.parameters())

    def step():
        # Grads set to None, not accumulated: no extra add kernel in any variant.
        x.grad = None
        for p in params:
            p.grad = None
        mod(x).backward(gy)

    return step


def numerics(k: int, n: int, m: int, device: str) -> dict:
    """SQNR (dB) of y, grad_x, grad_w against float64, per implementation and recipe."""
    torch.manual_seed(2)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    x[:, :8] *= 50.0  # outlier channels, as in LLM activations
    x[:4] = 0.0  # all-zero rows
    w = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
    gy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    x64, w64, gy64 = x.double(), w.double(), gy.double()
    ref = {"y": x64 @ w64.t(), "gx": gy64 @ w64, "gw": gy64.t() @ x64}
    xb = x.clone().requires_grad_()
    wb = w.clone().requires_grad_()
    yb = xb @ wb.t()
    yb.backward(gy)
    out = {"bf16": {"y": sqnr_db(yb, ref["y"]), "gx": sqnr_db(xb.grad, ref["gx"]), "gw": sqnr_db(wb.grad, ref["gw"])}}
    for impl in ("ours_eager", "torchao"):
        for recipe in OUR_RECIPES:
            key = f"{impl}/{recipe}"
            try:
                mod = build(impl, recipe, k, n, device)
                with torch.no_grad():
                    next(mod.parameters()).copy_(w)
                xi = x.clone().requires_grad_()
                y = mod(xi)
                y.backward(gy)
                gw = next(mod.parameters()).grad
                out[key] = {
                    "y": sqnr_db(y, ref["y"]),
                    "gx": sqnr_db(xi.grad, ref["gx"]),
                    "gw": sqnr_db(gw, ref["gw"]),
                }
            except Exception as e:  # noqa: BLE001  # record, keep benchmarking the rest
                out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def kernel_table(step, steps: int = 5) -> list[dict]:
    """GPU time per step by kernel (torch.profiler over `steps` steps): where a variant's fixed costs are."""
    rows = kernel_times(step, steps)
    total = sum(r["us_per_step"] for r in rows)
    print(f"    kernels: {total:.1f} us GPU per step", flush=True)
    for r in rows[:14]:
        print(f"    {r['us_per_step']:8.1f} us {r['calls_per_step']:4.1f}x  {r['kernel'][:100]}", flush=True)
    return rows


def worker(args) -> None:
    """Compile-cache warmer: build and run once every compiled case assigned to this worker."""
    todo = [c for c in cases(args.shapes, args.impls, args.recipes) if c[1] != "ours_eager"]
    todo = todo[args.worker :: args.nworkers]
    for shape, impl, recipe in todo:
        k, n = SHAPES[shape]
        try:
            make_step(build(impl, recipe, k, n, "cuda"), args.m, k, n, "cuda")()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"[warm {args.worker}] {shape} {impl} {recipe}: {type(e).__name__}: {e}"[:300], flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES)[:5])
    p.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--recipes", nargs="*", default=list(OUR_RECIPES), choices=OUR_RECIPES)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--prewarm", type=int, default=0, help="parallel compile-cache warmers (0: none)")
    p.add_argument("--skip-numerics", action="store_true")
    p.add_argument("--profile", action="store_true", help="kernel table (torch.profiler) of every timed case")
    p.add_argument("--worker", type=int, default=-1)
    p.add_argument("--nworkers", type=int, default=1)
    args = p.parse_args()
    if args.worker >= 0:
        worker(args)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = Budget(args.budget_s)
    result = {"env": env_info(), "m": args.m, "shapes": {s: SHAPES[s] for s in args.shapes}, "cases": []}
    print(result["env"], flush=True)
    if not args.skip_numerics:
        t0 = time.time()
        result["numerics"] = numerics(4096, 1024, 2048 if device == "cuda" else 64, device)
        print(f"numerics ({time.time() - t0:.0f}s)", result["numerics"], flush=True)
    if args.prewarm > 0 and device == "cuda":
        t0 = time.time()
        argv = ["--m", str(args.m), "--shapes", *args.shapes, "--impls", *args.impls, "--recipes", *args.recipes]
        codes = run_workers(os.path.abspath(__file__), argv, args.prewarm, timeout_s=max(30.0, budget.left() * 0.5))
        result["prewarm"] = {"workers": args.prewarm, "exit_codes": codes, "seconds": time.time() - t0}
        print("prewarm", result["prewarm"], flush=True)
    for shape, impl, recipe in cases(args.shapes, args.impls, args.recipes):
        k, n = SHAPES[shape]
        rec = {"shape": shape, "K": k, "N": n, "impl": impl, "recipe": recipe}
        if budget.left() <= 0:
            rec["skipped"] = "time budget spent"
            result["cases"].append(rec)
            continue
        try:
            t0 = time.time()
            step = make_step(build(impl, recipe, k, n, device), args.m, k, n, device)
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            rec["first_call_s"] = time.time() - t0
            rec["ms"] = bench_ms(step)
            rec["tflops"] = 3 * 2 * args.m * k * n / rec["ms"] / 1e9
            if args.profile and device == "cuda":
                rec["kernels"] = kernel_table(step)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        result["cases"].append(rec)
        print(rec, flush=True)
        torch.cuda.empty_cache() if device == "cuda" else None
    summarize(result)
    result["command"] = "python3 " + " ".join(sys.argv)
    write_json(os.path.join(args.out, "fp8_linear.json"), result)


def summarize(result: dict) -> None:
    """Add speedups over bf16 per shape and print the table."""
    by = {(c["shape"], c["impl"], c["recipe"]): c.get("ms") for c in result["cases"]}
    rows = []
    for shape in result["shapes"]:
        base = by.get((shape, "bf16", "-"))
        for r in OUR_RECIPES:
            ao = by.get((shape, "torchao", r))
            oe, oc = by.get((shape, "ours_eager", r)), by.get((shape, "ours_compiled", r))
            best = min([t for t in (oe, oc) if t], default=None)
            row = {
                "shape": shape,
                "recipe": r,
                "bf16_ms": base,
                "torchao_ms": ao,
                "ours_eager_ms": oe,
                "ours_compiled_ms": oc,
                "ours_best_ms": best,
                "torchao_speedup": base / ao if base and ao else None,
                "ours_speedup": base / best if base and best else None,
                "ours_vs_torchao": ao / best if ao and best else None,
            }
            rows.append(row)
    result["summary"] = rows

    def f(v, spec):
        return format(v, spec) if isinstance(v, float) else "-"

    print(
        f"{'shape':18s} {'recipe':14s} {'bf16':>7s} {'ao':>7s} {'eager':>7s} {'compl':>7s} {'ao x':>6s} {'ours x':>6s}"
    )
    for r in rows:
        print(
            f"{r['shape']:18s} {r['recipe']:14s} {f(r['bf16_ms'], '7.3f')} {f(r['torchao_ms'], '7.3f')} "
            f"{f(r['ours_eager_ms'], '7.3f')} {f(r['ours_compiled_ms'], '7.3f')} "
            f"{f(r['torchao_speedup'], '6.2f')} {f(r['ours_speedup'], '6.2f')}"
        )


if __name__ == "__main__":
    main()
