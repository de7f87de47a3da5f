"""MoE routed-expert FFN benchmark: bf16 grouped GEMM vs ours (fp8/grouped) vs torchao FP8 rowwise grouped.

    PYTHONUNBUFFERED=1 python3 benchmarks/moe_grouped.py --out $OUT [--budget-s 150] [--prewarm 3]

DeepSeek-MoE-16B routed experts (ANCHORS.md): 64 experts, dim 2048, expert hidden 1408, top-6 of 16384
tokens = 98304 routed rows, groups padded to multiples of 16 rows (as the FP8 grouped GEMM wants). One step
is the SwiGLU expert FFN forward + backward (grads of x, w1, w3, w2):

    h_MI = silu(gmm(x_MD, w1_EDI)) * gmm(x_MD, w3_EDI);  out_MD = gmm(h_MI, w2_EID)

Our weights use the models' layout ([E, in, out] row-major); torchao gets its preferred column-major
layout (a transposed [E, out, in] parameter), so no variant pays a layout copy it would not pay in training.
Writes moe_grouped.json to --out.

Legend: M routed rows, D model dim, I expert hidden dim, E experts.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch._dynamo
import torch.nn.functional as F

# Every shape and recipe is a new compiled module of the same classes: without this, dynamo's default of
# 8 recompiles per code object silently falls back to eager after the 8th case (seen on the first run).
torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.accumulated_recompile_limit = 4096

from benchmarks.common import Budget, bench_ms, env_info, run_workers, sqnr_db, write_json

CASES = ("bf16_compiled", "ours_eager", "ours_compiled", "torchao_compiled", "torchao_eager", "bf16_eager")
COMPILED = ("bf16_compiled", "ours_compiled", "torchao_compiled")


def group_offsets(m: int, e: int, align: int, device: str, seed: int = 0) -> torch.Tensor:
    """int32 cumulative ends of e groups summing to m, each a multiple of `align`, mildly imbalanced."""
    torch.manual_seed(seed)
    probs = torch.distributions.Gamma(torch.full((e,), 4.0), torch.ones(e)).sample()
    probs = probs / probs.sum()
    units = m // align
    counts = torch.floor(probs * units).long()
    counts[torch.argsort(probs, descending=True)[: units - int(counts.sum())]] += 1
    return (torch.cumsum(counts * align, 0)).to(torch.int32).to(device)


def grouped_fn(impl: str):
    """(x_MK, w, offs) -> out_MN for one implementation; w in that implementation's layout."""
    if impl.startswith("bf16"):
        return lambda x, w, offs: torch._grouped_mm(x, w, offs)
    if impl.startswith("ours"):
        from fp8 import Fp8GroupedMM

        return Fp8GroupedMM()
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return lambda x, w, offs: _to_fp8_rowwise_then_scaled_grouped_mm(
        x, w, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )


def make_weights(impl: str, e: int, d: int, i: int, device: str, gen) -> list[torch.Tensor]:
    """w1, w3, w2 leaves: [E, in, out] row-major, or [E, out, in] for torchao (column-major views)."""
    leaves = []
    for s in [(e, d, i), (e, d, i), (e, i, d)]:
        w = (torch.randn(*s, device=device, generator=gen) / s[1] ** 0.5).to(torch.bfloat16)
        if impl.startswith("torchao"):
            w = w.transpose(-2, -1).contiguous()  # stored [E, out, in]; ffn passes the transposed view
        leaves.append(w.requires_grad_())
    return leaves


def ffn(gmm, x_MD, w1, w3, w2, offs, col_major: bool):
    if col_major:
        w1, w3, w2 = (w.transpose(-2, -1) for w in (w1, w3, w2))
    h_MI = F.silu(gmm(x_MD, w1, offs)) * gmm(x_MD, w3, offs)
    return gmm(h_MI, w2, offs)


def build_step(impl: str, m: int, e: int, d: int, i: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    gy = torch.randn(m, d, device=device, dtype=torch.bfloat16, generator=gen)
    ws = make_weights(impl, e, d, i, device, gen)
    offs = group_offsets(m, e, 16, device)
    gmm = grouped_fn(impl)
    col_major = impl.startswith("torchao")

    def fwd(x, w1, w3, w2, offs):
        return ffn(gmm, x, w1, w3, w2, offs, col_major)

    f = torch.compile(fwd) if impl in COMPILED else fwd

    def step():
        x.grad = None
        for w in ws:
            w.grad = None
        f(x, *ws, offs).backward(gy)

    return step, (x, ws, offs, gy, fwd)


def numerics(device: str) -> dict:
    """SQNR (dB) of out and of the x / w grads against a float64 per-group reference, inputs with outliers."""
    m, e, d, i = (8192, 8, 1024, 512) if device == "cuda" else (256, 4, 64, 32)
    res = {}
    ref = None
    for impl in ("bf16_eager", "ours_eager", "torchao_eager"):
        try:
            _, (x, ws, offs, gy, fwd) = build_step(impl, m, e, d, i, device)
            with torch.no_grad():
                x[:, :4] *= 30.0  # outlier channels
                x[:16] = 0.0  # all-zero rows
            out = fwd(x, *ws, offs)
            out.backward(gy)
            got = {"out": out, "gx": x.grad}
            if impl.startswith("torchao"):
                got.update({f"g{n}": w.grad.transpose(-2, -1) for n, w in zip(("w1", "w3", "w2"), ws)})
            else:
                got.update({f"g{n}": w.grad for n, w in zip(("w1", "w3", "w2"), ws)})
            if ref is None:
                x64 = x.detach().double().requires_grad_()
                w64 = [w.detach().double().requires_grad_() for w in ws]
                bounds = [0, *offs.tolist()]

                def gmm64(a, b, bounds=bounds):
                    return torch.cat([a[s:t] @ b[g] for g, (s, t) in enumerate(itertools.pairwise(bounds))])

                o64 = gmm64(F.silu(gmm64(x64, w64[0])) * gmm64(x64, w64[1]), w64[2])
                o64.backward(gy.double())
                ref = {"out": o64, "gx": x64.grad, "gw1": w64[0].grad, "gw3": w64[1].grad, "gw2": w64[2].grad}
            res[impl] = {k: sqnr_db(v, ref[k]) for k, v in got.items()}
        except Exception as ex:  # noqa: BLE001
            res[impl] = {"error": f"{type(ex).__name__}: {ex}"[:300]}
    return res


def profile_top(step, top: int = 14) -> list[dict]:
    """GPU time per kernel name over one step (torch.profiler): where the FP8 step spends its time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": ev.key[:90], "ms": t / 1e3, "calls": ev.count})
    rows.sort(key=lambda r: -r["ms"])
    for r in rows[:top]:
        print(f"{r['ms']:8.3f} ms {r['calls']:4d}x  {r['kernel']}", flush=True)
    return rows[:40]


def worker(args) -> None:
    todo = list(COMPILED)[args.worker :: args.nworkers]
    for impl in todo:
        try:
            step, _ = build_step(impl, args.m, args.experts, args.dim, args.hidden, "cuda")
            step()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"[warm {args.worker}] {impl}: {type(e).__name__}: {e}"[:300], flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--m", type=int, default=16384 * 6)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1408)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--prewarm", type=int, default=0)
    p.add_argument("--skip-numerics", action="store_true")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--profile", action="store_true", help="print the top GPU kernels of one ours_eager step")
    p.add_argument("--worker", type=int, default=-1)
    p.add_argument("--nworkers", type=int, default=1)
    args = p.parse_args()
    if args.worker >= 0:
        worker(args)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = Budget(args.budget_s)
    m, e, d, i = args.m, args.experts, args.dim, args.hidden
    result = {"env": env_info(), "problem": {"rows": m, "experts": e, "dim": d, "hidden": i}, "cases": []}
    if not args.skip_numerics:
        result["numerics"] = numerics(device)
        print("numerics", result["numerics"], flush=True)
    if args.prewarm > 0 and device == "cuda":
        t0 = time.time()
        argv = ["--m", str(m), "--experts", str(e), "--dim", str(d), "--hidden", str(i)]
        codes = run_workers(os.path.abspath(__file__), argv, args.prewarm, timeout_s=max(30.0, budget.left() * 0.6))
        result["prewarm"] = {"workers": args.prewarm, "exit_codes": codes, "seconds": time.time() - t0}
        print("prewarm", result["prewarm"], flush=True)
    flops = 3 * 3 * 2 * m * d * i  # three GEMMs, forward + two backward GEMMs each
    for impl in args.cases:
        rec = {"impl": impl}
        if budget.left() <= 0:
            rec["skipped"] = "time budget spent"
            result["cases"].append(rec)
            continue
        try:
            t0 = time.time()
            step, _ = build_step(impl, m, e, d, i, device)
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            rec["first_call_s"] = time.time() - t0
            rec["ms"] = bench_ms(step)
            rec["tflops"] = flops / rec["ms"] / 1e9
        except Exception as ex:  # noqa: BLE001
            rec["error"] = f"{type(ex).__name__}: {ex}"[:400]
            traceback.print_exc()
        result["cases"].append(rec)
        print(rec, flush=True)
    if args.profile and device == "cuda" and budget.left() > 0:
        result["profile_ours_eager"] = profile_top(build_step("ours_eager", m, e, d, i, device)[0])
    by = {c["impl"]: c.get("ms") for c in result["cases"]}
    base = by.get("bf16_compiled") or by.get("bf16_eager")
    result["speedup_vs_bf16_grouped"] = {k: base / v for k, v in by.items() if v and base}
    print(f"{'impl':18s} {'ms':>8s} {'x bf16':>7s}")
    for k, v in by.items():
        print(f"{k:18s} {v if v else float('nan'):8.3f} {result['speedup_vs_bf16_grouped'].get(k, float('nan')):7.2f}")
    write_json(os.path.join(args.out, "moe_grouped.json"), result)


if __name__ == "__main__":
    main()
