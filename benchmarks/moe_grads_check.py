"""Diagnostic: do compiled FP8 MoE blocks compute the gradients the eager model computes, per grouped-GEMM mode and
torch.compile backend?

    python3 benchmarks/moe_grads_check.py [--layers 2] [--cases opaque:inductor,traced:aot_eager,...]

Builds the full-width DeepSeek-MoE model (our rowwise FP8) once eagerly and once per case, all from the same
initialization and batch, and prints per parameter group the relative error of the gradient against the eager one
and its fraction of exactly-zero entries. (Written after an H200 run found every routed expert's weight gradient
exactly zero in our compiled FP8 MoE step with the grouped GEMM traced into the graph: session3/optimizer_gap.json.)
A case is mode:backend, mode one of fp8.grouped.GROUPED_MODES, backend inductor | aot_eager | eager.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.train_step import CONFIGS, build, random_batches
from models.loss import lm_loss

GROUPS = ("experts.w13", "experts.w2", "moe.gate", "shared_experts", "attention", "tok_embeddings")


def grads_of(model, inputs, targets, compiled_loss: bool) -> tuple[float, dict[str, torch.Tensor]]:
    loss = lm_loss(model(inputs), targets, compiled=compiled_loss) + model.aux_loss()
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--variant", default="ours:rowwise")
    ap.add_argument("--cases", default="opaque:inductor,eager:inductor,traced:aot_eager,traced:inductor")
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    cfg = CONFIGS["moe"]
    overrides = dict(cfg["overrides"], n_layers=args.layers)

    def fresh(compile_backend: str | None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build(cfg["model"], overrides, args.variant, device, compile_blocks=False)
        if compile_backend:
            for block in model.layers.values():
                block.compile(dynamic=False, backend=compile_backend)
        return model

    os.environ["FP8_GROUPED_MODE"] = "eager"
    model = fresh(None)
    inputs, targets = random_batches(model.args.vocab_size, cfg["batch"], cfg["seq"], device, n=1)[0]
    ref_loss, ref = grads_of(model, inputs, targets, compiled_loss=False)
    model = None
    print(f"eager reference: loss {ref_loss:.5f}", flush=True)
    for case in args.cases.split(","):
        mode, backend = case.split(":")
        os.environ["FP8_GROUPED_MODE"] = mode
        try:
            loss, got = grads_of(fresh(backend), inputs, targets, compiled_loss=False)
        except Exception as exc:  # noqa: BLE001  # report and go on to the next case
            print(f"{case:22s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        parts = []
        for group in GROUPS:
            names = [n for n in ref if group in n]
            if not names:
                continue
            num = sum((got[n] - ref[n]).norm() ** 2 for n in names) ** 0.5
            den = sum(ref[n].norm() ** 2 for n in names) ** 0.5
            zero = sum((got[n] == 0).sum().item() for n in names) / sum(got[n].numel() for n in names)
            parts.append(f"{group} rel {float(num / den):.2e} zero {zero:.3f}")
        print(f"{case:22s} loss {loss:.5f} (diff {loss - ref_loss:+.2e})\n    " + "\n    ".join(parts), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
