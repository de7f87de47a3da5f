"""MoE routed-expert FFN benchmark: bf16 grouped GEMM vs ours (fp8/grouped) vs torchao FP8 rowwise grouped.

    PYTHONUNBUFFERED=1 python3 benchmarks/moe_grouped.py --out $OUT [--budget-s 150] [--prewarm 3]

DeepSeek-MoE-16B routed experts: 64 experts, dim 2048, expert hidden 1408, top-6 of 16384
tokens = 98304 routed rows, groups padded to multiples of 16 rows (as the FP8 grouped GEMM wants). One step
is the models' GroupedExperts (models/deepseek_moe.py) forward + backward (grads of x, w13, w2):

    y_MJ = gmm(x_MD, w13_EJD^T);  h_MI = silu(y[:, :I]) * y[:, I:];  out_MD = gmm(h_MI, w2_EDI^T)

Every variant runs that same module, weights stored [E, out, in] (torchtitan's layout, torchao's preferred one),
swapping only its `grouped_mm`: bf16 torch._grouped_mm; ours fp8.Fp8GroupedMM (fp8 forward and grad input, bf16 weight
gradient); torchao's FP8 rowwise grouped GEMM. --breakdown also times each grouped GEMM
alone (bf16 vs fp8 operands already cast) and each cast, so the step time can be split into GEMMs and casts.
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

from fp8.backend import fp8_dtypes

# Every shape and recipe is a new compiled module of the same classes: without this, dynamo's default of
# 8 recompiles per code object silently falls back to eager after the 8th case (seen on the first run).
torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.accumulated_recompile_limit = 4096

from benchmarks.common import Budget, bench_ms, env_info, kernel_times, run_workers, sqnr_db, write_json

CASES = ("bf16_compiled", "ours_compiled", "torchao_compiled", "ours_eager", "torchao_eager", "bf16_eager")
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
    """(x_MK, w_EKN, offs) -> out_MN for one implementation (w_EKN: the column-major view of [E, N, K])."""
    if impl.startswith("bf16"):
        from models.deepseek_moe import grouped_mm_hp

        return grouped_mm_hp
    if impl.startswith("ours"):
        from fp8 import Fp8GroupedMM

        return Fp8GroupedMM()
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return lambda x, w, offs: _to_fp8_rowwise_then_scaled_grouped_mm(
        x, w, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )


def make_experts(impl: str, e: int, d: int, i: int, device: str):
    from models.deepseek_moe import GroupedExperts

    experts = GroupedExperts(e, d, i).to(device)
    torch.manual_seed(0)
    experts.init_weights(d**-0.5, i**-0.5)
    experts.to(torch.bfloat16)
    experts.grouped_mm = grouped_fn(impl)
    return experts


def build_step(impl: str, m: int, e: int, d: int, i: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    gy = torch.randn(m, d, device=device, dtype=torch.bfloat16, generator=gen)
    experts = make_experts(impl, e, d, i, device)
    offs = group_offsets(m, e, 16, device)
    f = torch.compile(experts, dynamic=False) if impl in COMPILED else experts

    def step():
        x.grad = None
        experts.zero_grad(set_to_none=True)
        f(x, offs).backward(gy)

    return step, (x, experts, offs, gy)


def numerics(device: str) -> dict:
    """SQNR (dB) of out and of the x / w grads against a float64 per-group reference, inputs with outliers."""
    m, e, d, i = (8192, 8, 1024, 512) if device == "cuda" else (256, 4, 64, 32)
    res = {}
    ref = None
    for impl in ("bf16_eager", "ours_eager", "torchao_eager"):
        try:
            _, (x, experts, offs, gy) = build_step(impl, m, e, d, i, device)
            with torch.no_grad():
                x[:, :4] *= 30.0  # outlier channels
                x[:16] = 0.0  # all-zero rows
            out = experts(x, offs)
            out.backward(gy)
            got = {"out": out, "gx": x.grad, "gw13": experts.w13.grad, "gw2": experts.w2.grad}
            if ref is None:
                x64 = x.detach().double().requires_grad_()
                w13, w2 = (w.detach().double().requires_grad_() for w in (experts.w13, experts.w2))
                bounds = [0, *offs.tolist()]

                def gmm64(a, b_ENK, bounds=bounds):
                    return torch.cat([a[s:t] @ b_ENK[g].t() for g, (s, t) in enumerate(itertools.pairwise(bounds))])

                y64 = gmm64(x64, w13)
                o64 = gmm64(F.silu(y64[:, :i]) * y64[:, i:], w2)
                o64.backward(gy.double())
                ref = {"out": o64, "gx": x64.grad, "gw13": w13.grad, "gw2": w2.grad}
            res[impl] = {k: sqnr_db(v, ref[k]) for k, v in got.items()}
        except Exception as ex:  # noqa: BLE001
            res[impl] = {"error": f"{type(ex).__name__}: {ex}"[:300]}
    return res


def _breakdown_cases(name, a_MK, w_ENK, g_MN, offs, one_m, q, quant, f8) -> dict:
    """The timed callables of one GEMM family (w13 or w2): bf16 and fp8 GEMMs, then the casts around them."""
    e, n, k = w_ENK.shape
    device = a_MK.device
    a8, w8, g8 = q(a_MK), q(w_ENK), q(g_MN)
    w8_EKN = q(w_ENK.transpose(-2, -1).contiguous())
    a8_t, g8_t = q(a_MK.t().contiguous()), q(g_MN.t().contiguous())
    ones_en, ones_ek = torch.ones(e, n, device=device), torch.ones(e, k, device=device)
    ones_e_n, ones_e_k = torch.ones(e * n, device=device), torch.ones(e * k, device=device)
    bf16 = torch.bfloat16
    return {
        f"fwd{name}_bf16": lambda: torch._grouped_mm(a_MK, w_ENK.transpose(-2, -1), offs),
        f"fwd{name}_fp8": lambda: torch._scaled_grouped_mm(a8, w8.transpose(-2, -1), one_m, ones_en, offs,
                                                             out_dtype=bf16, use_fast_accum=True),
        f"dgrad{name}_bf16": lambda: torch._grouped_mm(g_MN, w_ENK, offs),
        f"dgrad{name}_fp8": lambda: torch._scaled_grouped_mm(g8, w8_EKN.transpose(-2, -1), one_m, ones_ek, offs,
                                                               out_dtype=bf16),
        f"wgrad{name}_bf16": lambda: torch._grouped_mm(g_MN.t(), a_MK, offs),
        f"wgrad{name}_fp8": lambda: torch._scaled_grouped_mm(g8_t, a8_t.t(), ones_e_n, ones_e_k, offs, out_dtype=bf16),
        # The fp8 dgrad / wgrad GEMMs with fast accumulation (fp8.grouped runs its grad input so; its weight gradient
        # stays bf16): at w2's k = 1408 the promoted fp8 dgrad ran at 0.56x of bf16 (1.794 vs 1.007 ms), fast
        # accumulation at 1.63x (0.616 ms).
        f"dgrad{name}_fp8_fa": lambda: torch._scaled_grouped_mm(g8, w8_EKN.transpose(-2, -1), one_m, ones_ek, offs,
                                                                  out_dtype=bf16, use_fast_accum=True),
        f"wgrad{name}_fp8_fa": lambda: torch._scaled_grouped_mm(g8_t, a8_t.t(), ones_e_n, ones_e_k, offs,
                                                                  out_dtype=bf16, use_fast_accum=True),
        f"cast_rowcol_act{name}": lambda: quant.quantize_rowwise_and_colwise(a_MK, f8, True),
        f"cast_rowcol_grad{name}": lambda: quant.quantize_rowwise_and_colwise(g_MN, f8, True),
        f"cast_rowwise_act{name}": lambda: quant.quantize_rowwise(a_MK, f8, -1, True),
        f"cast_w_fwd{name}": lambda: quant.quantize_colwise_3d(w_ENK.transpose(-2, -1), f8, True),
        f"cast_w_bwd{name}": lambda: quant.quantize_rowwise(w_ENK.transpose(-2, -1), f8, -1, True)[0].contiguous(),
    }


def gemm_breakdown(m: int, e: int, d: int, i: int, device: str) -> dict:
    """Each of the step's six grouped GEMMs alone, bf16 vs fp8 operands already cast (torch._scaled_grouped_mm,
    the layouts fp8/grouped.py uses), and the casts fp8/grouped.py runs: the step splits into GEMMs + casts."""
    from fp8 import quant

    f8 = fp8_dtypes(device)[0]  # e4m3fnuz (max 240) on MI300, e4m3fn elsewhere
    f8_max = torch.finfo(f8).max
    gen = torch.Generator(device=device).manual_seed(0)
    offs = group_offsets(m, e, 16, device)

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)

    def q(t):  # fp8 copy with unit scales (GEMM timing only)
        return t.clamp(-f8_max, f8_max).to(f8)

    out = {}
    one_m, j = torch.ones(m, device=device), 2 * i
    for name, (k, n) in {"13": (d, j), "2": (i, d)}.items():
        a_MK, w_ENK, g_MN = rnd(m, k), rnd(e, n, k), rnd(m, n)
        cases = _breakdown_cases(name, a_MK, w_ENK, g_MN, offs, one_m, q, quant, f8)
        for key, fn in cases.items():
            try:
                out[key] = bench_ms(fn)
            except Exception as ex:  # noqa: BLE001
                out[key] = f"{type(ex).__name__}: {ex}"[:200]
            print(f"  {key:22s} {out[key] if isinstance(out[key], str) else f'{out[key]:.3f} ms'}", flush=True)
    return out


def profile_top(step, top: int = 14) -> list[dict]:
    """GPU time per kernel name over one step (torch.profiler): where the FP8 step spends its time."""
    step()
    rows = [{"kernel": r["kernel"], "ms": r["us_per_step"] / 1e3, "calls": int(r["calls_per_step"])}
            for r in kernel_times(step, 1, name_chars=90)]
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


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """--out and the DeepSeek-MoE-16B routed-expert shape."""
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--m", type=int, default=16384 * 6)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1408)


def main() -> None:
    p = argparse.ArgumentParser()
    add_shape_args(p)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--prewarm", type=int, default=0)
    p.add_argument("--skip-numerics", action="store_true")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--profile", nargs="*", default=[], help="print the top GPU kernels of one step of these cases")
    p.add_argument("--breakdown", action="store_true", help="time each grouped GEMM and cast alone")
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
    if args.breakdown and device == "cuda" and budget.left() > 0:
        print("breakdown (ms):", flush=True)
        result["breakdown_ms"] = gemm_breakdown(m, e, d, i, device)
    for impl in args.profile:
        if device == "cuda" and budget.left() > 0:
            print(f"profile {impl}:", flush=True)
            try:
                result[f"profile_{impl}"] = profile_top(build_step(impl, m, e, d, i, device)[0])
            except Exception as ex:  # noqa: BLE001
                print(f"profile {impl} failed: {type(ex).__name__}: {ex}"[:300], flush=True)
    by = {c["impl"]: c.get("ms") for c in result["cases"]}
    base = by.get("bf16_compiled") or by.get("bf16_eager")
    result["speedup_vs_bf16_grouped"] = {k: base / v for k, v in by.items() if v and base}
    print(f"{'impl':18s} {'ms':>8s} {'x bf16':>7s}")
    for k, v in by.items():
        print(f"{k:18s} {v if v else float('nan'):8.3f} {result['speedup_vs_bf16_grouped'].get(k, float('nan')):7.2f}")
    write_json(os.path.join(args.out, "moe_grouped.json"), result)


if __name__ == "__main__":
    main()
