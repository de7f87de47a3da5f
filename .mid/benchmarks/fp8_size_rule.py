"""Where FP8 pays: one linear's and one expert group's forward + backward, bf16 vs ours in FP8, over GEMM sizes.

    PYTHONUNBUFFERED=1 python3 benchmarks/fp8_size_rule.py --out $OUT [--budget-s 240]

fp8.size_rule decides per linear (and per group of routed experts) whether its GEMMs are large enough for FP8 to
win over bf16 once its casts are paid for; this sweep measures where that boundary lies on the GPU it runs on.
Each case is compiled as the product compiles its blocks (torch.compile, the token dimension dynamic so one
compile serves every M of a shape), timed with triton's do_bench (median), bf16 first, in one process.

Rows: dense linears (K -> N) at M tokens, recipe tensorwise (the NVIDIA default); routed experts (E groups, dim D,
hidden I) at M tokens routed x top-k rows. Writes fp8_size_rule.json to --out: per case bf16 ms, fp8 ms, speedup.

Legend: M tokens (rows), K in_features, N out_features.
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

torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.accumulated_recompile_limit = 4096

from benchmarks.common import bench_ms, write_result

# (K, N) of the linears of the model presets, and smaller ones to find the boundary.
LINEAR_SHAPES = [(512, 512), (1024, 1024), (2048, 2048), (2048, 2816), (2816, 2048), (2048, 10944), (4096, 1024),
                 (4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096)]
TOKENS = [1024, 2048, 4096, 8192, 16384]
# Routed experts: (E, D, I, top-k) of deepseek_moe16b, at these tokens per micro-batch.
EXPERTS = (64, 2048, 1408, 6)
EXPERT_TOKENS = [1024, 2048, 4096, 8192, 16384]


def linear_case(k: int, n: int, fp8: bool):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    if fp8:
        from fp8 import Float8Linear

        lin = Float8Linear.from_float(lin, "tensorwise")
    f = torch.compile(lin)

    def step_for(m: int):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
        torch._dynamo.mark_dynamic(x, 0)  # one compile per shape serves every M
        gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def step():
            x.grad = None
            lin.weight.grad = None
            f(x).backward(gy)

        return step

    return step_for


def expert_case(fp8_on: bool):
    from benchmarks.moe_grouped import build_step

    e, d, i, topk = EXPERTS

    def step_for(m_tokens: int):
        step, _ = build_step("ours_compiled" if fp8_on else "bf16_compiled", m_tokens * topk, e, d, i, "cuda")
        return step

    return step_for


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--budget-s", type=float, default=240.0)
    args = p.parse_args()
    t_start = time.time()
    rows = []
    cases = [("linear", k, n) for k, n in LINEAR_SHAPES] + [("experts", 0, 0)]
    for kind, k, n in cases:
        if time.time() - t_start > args.budget_s:
            print(f"budget spent: {kind} {k}x{n} and later not timed")
            break
        try:
            makers = ([linear_case(k, n, False), linear_case(k, n, True)] if kind == "linear"
                      else [expert_case(False), expert_case(True)])
            for m in (TOKENS if kind == "linear" else EXPERT_TOKENS):
                ms = [bench_ms(make(m)) for make in makers]
                row = {"kind": kind, "m": m, "k": k, "n": n, "bf16_ms": round(ms[0], 4), "fp8_ms": round(ms[1], 4),
                       "speedup": round(ms[0] / ms[1], 3)}
                if kind == "experts":
                    row.update(zip(("experts", "dim", "hidden", "topk"), EXPERTS))
                rows.append(row)
                print(f"{kind:8s} M={m:6d} K={k:6d} N={n:6d}  bf16 {ms[0]:8.4f} ms  fp8 {ms[1]:8.4f} ms  "
                      f"x{ms[0] / ms[1]:.3f}", flush=True)
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001  # one failing shape must not lose the rows already timed
            traceback.print_exc()
            rows.append({"kind": kind, "k": k, "n": n, "error": traceback.format_exc(limit=2)})
    command = "python3 benchmarks/fp8_size_rule.py " + " ".join(sys.argv[1:])
    write_result(os.path.join(args.out, "fp8_size_rule.json"), benchmark="fp8_size_rule", suite="size_rule",
                 command=command, suite_command=command, returncode=0, wall_s=time.time() - t_start,
                 results={"rows": rows, "recipe": "tensorwise", "compiled": True})


if __name__ == "__main__":
    main()
