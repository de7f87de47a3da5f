"""Why the fused AdamW step is slower after our FP8 MoE step than after the bf16 one (19.0 vs 12.6 ms on the H200,
same parameters, same gradient layouts: session3/train_step_moe_call1.json). One experiment per hypothesis:

    python3 benchmarks/optimizer_gap.py --out $OUT [--moe-layers 4]

For each variant (bf16, ours:rowwise), after one forward/backward, times optimizer.step() (median of 5) when:
- as_is:          the gradients autograd left
- after_sleep:    the same after 3 s idle (power/clock state after the FP8 GEMMs)
- grads_cloned:   every gradient copied to a fresh allocation (where the gradients live)
- grads_random:   gradients replaced by N(0, rms of the real ones) (what values they hold)
- fresh_states:   a new AdamW (where the optimizer states live, and their values)
and records gradient statistics (fraction exactly zero, fraction whose square is an fp32 subnormal).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import env_info, write_json
from benchmarks.train_step import CONFIGS, build, random_batches, time_optimizer_step
from models.loss import lm_loss


def forward_backward(model, optimizer, inputs, targets) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model(inputs), targets, compiled=True) + model.aux_loss()
    loss.backward()


def grad_stats(params) -> dict:
    numel = sum(p.numel() for p in params)
    zeros = sum((p.grad == 0).sum().item() for p in params)
    # |g| below sqrt(smallest normal fp32) makes g*g (AdamW's second moment) an fp32 subnormal
    tiny = sum(((p.grad != 0) & (p.grad.float().abs() < 1.0842e-19)).sum().item() for p in params)
    rms = (sum(p.grad.float().square().sum().item() for p in params) / numel) ** 0.5
    return {"zero_frac": zeros / numel, "subnormal_square_frac": tiny / numel, "rms": rms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--variants", default="bf16,ours:rowwise")
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    cfg = CONFIGS["moe"]
    overrides = dict(cfg["overrides"], n_layers=args.moe_layers)
    result = {"command": "python3 " + " ".join(sys.argv), "env": env_info(), "rows": []}
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        model = build(cfg["model"], overrides, variant, device, compile_blocks=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        inputs, targets = random_batches(model.args.vocab_size, cfg["batch"], cfg["seq"], device, n=1)[0]
        fwd_bwd = functools.partial(forward_backward, model, optimizer, inputs, targets)
        fwd_bwd()
        optimizer.step()  # states exist from here on, as in training
        fwd_bwd()
        params = [p for p in model.parameters() if p.grad is not None]
        row = {"variant": variant, "grad_stats": grad_stats(params)}
        row["as_is_ms"] = time_optimizer_step(optimizer)
        fwd_bwd()
        time.sleep(3.0)
        row["after_sleep_ms"] = time_optimizer_step(optimizer)
        fwd_bwd()
        for p in params:
            p.grad = p.grad.clone()
        row["grads_cloned_ms"] = time_optimizer_step(optimizer)
        rms = row["grad_stats"]["rms"]
        for p in params:
            p.grad = torch.randn_like(p.grad) * rms
        row["grads_random_ms"] = time_optimizer_step(optimizer)
        fwd_bwd()
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        fresh.step()
        row["fresh_states_ms"] = time_optimizer_step(fresh)
        states = [s for st in optimizer.state.values() for k, s in st.items() if k == "exp_avg_sq"]
        row["exp_avg_sq_subnormal_frac"] = (sum(((s != 0) & (s.float().abs() < 1.1755e-38)).sum().item()
                                                 for s in states) / sum(s.numel() for s in states))
        print(variant, row, flush=True)
        result["rows"].append(row)
        model = optimizer = fresh = params = states = None
        gc.collect()
        torch.cuda.empty_cache()
    write_json(os.path.join(args.out, "optimizer_gap.json"), result)


if __name__ == "__main__":
    main()
