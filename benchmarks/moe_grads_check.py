"""Diagnostic: do the routed experts of the full-width MoE model get gradients in each variant, eager and compiled?

    python3 benchmarks/moe_grads_check.py [--layers 2] [--traced] [--backend aot_eager]

Prints, per (variant, compiled): the fraction of exactly-zero gradient entries of every expert weight, the mean |y|
of the first MoE layer's experts output, and the group offsets it saw. (Written after an H200 run found 81 % of all
gradient entries exactly zero in our FP8 MoE step vs 8 % in bf16: session3/optimizer_gap.json.)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.train_step import CONFIGS, build, random_batches
from models.loss import lm_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--variants", default="bf16,ours:rowwise")
    ap.add_argument("--compiled-only", action="store_true")
    ap.add_argument("--traced", action="store_true",
                    help="let torch.compile trace Fp8GroupedMM (the path that zeroed the expert gradients)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend: inductor | aot_eager | eager")
    args = ap.parse_args()
    if args.traced:
        import fp8.grouped

        fp8.grouped.Fp8GroupedMM.__call__ = fp8.grouped.Fp8GroupedMM.call_traceable
    device = torch.device("cuda", 0)
    cfg = CONFIGS["moe"]
    for variant in args.variants.split(","):
        for compiled in (True,) if args.compiled_only else (False, True):
            torch._dynamo.reset()
            model = build(cfg["model"], dict(cfg["overrides"], n_layers=args.layers), variant, device,
                          compile_blocks=False)
            if compiled:
                for block in model.layers.values():
                    block.compile(dynamic=False, backend=args.backend)
            inputs, targets = random_batches(model.args.vocab_size, cfg["batch"], cfg["seq"], device, n=1)[0]
            seen = {}
            experts = model.layers["1"].moe.experts

            def hook(mod, a, out, seen=seen):
                seen.update(y=out.detach().float().abs().mean().item(), offs=a[1].detach().cpu(),
                            x=a[0].detach().float().abs().mean().item(), rows=a[0].shape[0])

            experts.register_forward_hook(hook)
            loss = lm_loss(model(inputs), targets, compiled=compiled) + model.aux_loss()
            loss.backward()
            zeros = {n: round((p.grad == 0).float().mean().item(), 4) for n, p in model.named_parameters()
                     if "experts.w" in n or n.endswith("gate.weight")}
            offs = seen["offs"]
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            print(f"{variant:14s} compiled={compiled!s:5s} loss {loss.item():.4f} grouped_mm={experts.grouped_mm!r}\n"
                  f"   experts |x| {seen['x']:.3e} |y| {seen['y']:.3e} rows {seen['rows']} offs[-1] "
                  f"{int(offs[-1])} group sizes min {int(sizes.min())} max {int(sizes.max())} "
                  f"all %16: {bool((sizes % 16 == 0).all())}\n   zero-grad fraction {zeros}", flush=True)
            model = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
