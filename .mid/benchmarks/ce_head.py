"""The fused FP8 head's loss kernels alone (fp8/kernels/cross_entropy.py) against what they replace, on one GPU.

    PYTHONUNBUFFERED=1 python3 benchmarks/ce_head.py --out $OUT [--tokens 16384 --vocab 102400]

Rows (ms, median of --reps, CUDA events; bytes = least traffic of each, GB/s against it):
- copy of the bf16 logits (read + write): the bandwidth yardstick;
- Inductor's compiled cross-entropy, forward alone and forward + backward (what an unfused head runs);
- the unfused FP8 head's gradient chain after the loss backward: tensorwise amax + cast to e5m2 + fp8 transpose;
- ours: the forward kernel (rows per program, tile, warps) and the backward cast kernel (tiles and warps; the
  transposed copy stored by the kernel or by a separate transpose pass), each checked against the reference first.
DeepSeek-MoE-16B's head at 16384 tokens by default (vocab 102400). Writes ce_head.json to --out.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import bandwidth_row, env_info, write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    from fp8 import quant as K
    from fp8.kernels import cross_entropy as ce
    from fp8.reference import cross_entropy_fwd_ref, cross_entropy_grad_cast_ref
    from models.loss import token_cross_entropy

    M, V = args.tokens, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(M, V, device="cuda", generator=g) * 3).bfloat16()
    targets = torch.randint(0, V, (M,), device="cuda", generator=g)
    nbytes_in = logits.numel() * 2
    rows = []

    def row(name, fn, traffic_bytes):
        bandwidth_row(rows, name, fn, traffic_bytes, args.reps)

    row("copy bf16 logits", lambda: logits.clone(), 2 * nbytes_in)
    compiled_ce = torch.compile(token_cross_entropy, dynamic=False)
    with torch.no_grad():
        row("inductor CE forward", lambda: compiled_ce(logits[None], targets[None]), nbytes_in)
    leaf = logits.detach().requires_grad_()

    def inductor_fwd_bwd():
        leaf.grad = None
        compiled_ce(leaf[None], targets[None]).backward()

    row("inductor CE forward + backward (bf16 gradient)", inductor_fwd_bwd, 3 * nbytes_in)
    grad_bf16 = leaf.grad.detach()

    def unfused_chain():
        g8, _ = K.quantize_tensorwise(grad_bf16, torch.float8_e5m2)
        K.transpose(g8)

    row("unfused head: amax + cast e5m2 + fp8 transpose of the gradient", unfused_chain,
        2 * nbytes_in + nbytes_in // 2 + nbytes_in)

    lse_r, _, gam_r = cross_entropy_fwd_ref(logits[:256], targets[:256])
    fwd_default = (ce.CE_FWD_TILE, ce.CE_FWD_WARPS)
    for tile, warps in (((1, 2048), 4), ((1, 4096), 8), ((1, 1024), 4), ((1, 1024), 2), ((2, 2048), 8),
                        ((2, 1024), 4), ((1, 8192), 8), ((4, 512), 4)):
        ce.CE_FWD_TILE, ce.CE_FWD_WARPS = tile, warps
        lse, _, gam = K.cross_entropy_fwd(logits, targets)
        ok = torch.allclose(lse[:256], lse_r, rtol=1e-5, atol=1e-4) and torch.allclose(gam[:256], gam_r, rtol=1e-3,
                                                                                        atol=1e-6)
        row(f"ours forward tile={tile} warps={warps} ok={ok}", lambda: K.cross_entropy_fwd(logits, targets), nbytes_in)
    ce.CE_FWD_TILE, ce.CE_FWD_WARPS = fwd_default
    lse, _, gam = K.cross_entropy_fwd(logits, targets)
    coef = torch.tensor(1.0 / M, device="cuda")
    gamax = gam.amax()
    ref = cross_entropy_grad_cast_ref(logits[:512], targets[:512], lse[:512], gamax, coef, torch.float8_e5m2)
    g8_full = K.cross_entropy_grad_cast(logits, targets, lse, gamax, coef, torch.float8_e5m2)[0]
    row("fp8 transpose of the gradient alone", lambda: K.transpose(g8_full), nbytes_in)
    bwd_default = (ce.CE_BWD_TILE, ce.CE_BWD_WARPS, ce.CE_BWD_FUSED_T)
    # fused_t: the kernel stores the transposed tile too; else a separate transpose pass (counted in the time)
    for fused_t, tile, warps in ((True, (16, 256), 4), (True, (32, 128), 4), (True, (16, 512), 4),
                                 (True, (32, 256), 8), (True, (64, 64), 4),
                                 (False, (16, 256), 4), (False, (8, 1024), 4), (False, (16, 1024), 8),
                                 (False, (32, 512), 8), (False, (4, 2048), 8), (False, (64, 128), 4),
                                 (False, (16, 512), 4)):
        ce.CE_BWD_TILE, ce.CE_BWD_WARPS, ce.CE_BWD_FUSED_T = tile, warps, fused_t
        g8, g8t, _ = K.cross_entropy_grad_cast(logits[:512], targets[:512], lse[:512], gamax, coef, torch.float8_e5m2)
        # GPU exp vs torch's may differ in the last fp32 bit: an element one fp8 step off, rarely
        off = (g8.view(torch.int8) != ref[0].view(torch.int8)).float().mean().item()
        same_t = torch.equal(g8t.view(torch.int8), g8.t().contiguous().view(torch.int8))
        row(f"ours backward fused_t={fused_t} tile={tile} warps={warps} off={off:.1e} t={same_t}",
            lambda: K.cross_entropy_grad_cast(logits, targets, lse, gamax, coef, torch.float8_e5m2),
            nbytes_in + nbytes_in)
    ce.CE_BWD_TILE, ce.CE_BWD_WARPS, ce.CE_BWD_FUSED_T = bwd_default
    fwd = [r for r in rows if r["case"].startswith("ours forward") and "ok=True" in r["case"]]
    bwd = [r for r in rows if r["case"].startswith("ours backward") and "t=True" in r["case"]]
    best = {"forward": min(fwd, key=lambda r: r["ms"])["case"] if fwd else None,
            "backward": min(bwd, key=lambda r: r["ms"])["case"] if bwd else None}
    print("best:", best, flush=True)
    write_json(os.path.join(args.out, "ce_head.json"), {"command": "python3 " + " ".join(sys.argv), "env": env_info(),
                                                        "tokens": M, "vocab": V, "rows": rows, "best": best})


def apply_best(path: str) -> dict:
    """Set fp8.kernels.cross_entropy's tile constants to the fastest valid rows of a ce_head.json (for A/B runs of
    train_step.py in the same call); returns what it set."""
    import json
    import re

    from fp8.kernels import cross_entropy as ce

    with open(path) as f:
        best = json.load(f)["best"]
    out = {}
    if best.get("forward"):
        m = re.search(r"tile=\((\d+), (\d+)\) warps=(\d+)", best["forward"])
        ce.CE_FWD_TILE, ce.CE_FWD_WARPS = (int(m[1]), int(m[2])), int(m[3])
        out["forward"] = best["forward"]
    if best.get("backward"):
        # sweeps of the first backward kernel have no "fused_t=": it always stored the transposed copy itself
        m = re.search(r"(?:fused_t=(\w+) )?tile=\((\d+), (\d+)\) warps=(\d+)", best["backward"])
        ce.CE_BWD_FUSED_T = m[1] in (None, "True")
        ce.CE_BWD_TILE, ce.CE_BWD_WARPS = (int(m[2]), int(m[3])), int(m[4])
        out["backward"] = best["backward"]
    return out


if __name__ == "__main__":
    main()
