"""AdamW step with the gradient clip on one GPU: torch's fused AdamW after clip_grads_with_norm_ vs optim.ChunkedAdamW.

    PYTHONUNBUFFERED=1 python3 benchmarks/adamw.py --out $OUT [--models llama3_8b:8 deepseek_moe16b:4]

The parameters are those of the models train_step.py times (built on meta, materialized with random values), in
bf16 (train_step.py: bf16 weights and states) and fp32 (the worker: fp32 master weights under autocast). Per case:
ms per step (CUDA events, median of --reps after warm-up; the clip's scaling pass included on torch's side, inside
the launch on ours), the bytes each step must move (param, grad, exp_avg, exp_avg_sq read; param and states
written) over the time, and the largest difference between the two implementations after --check-steps identical
steps from identical states (relative to the largest parameter change), so a fast wrong kernel cannot pass.
Block-size candidates for the kernel are timed too (--blocks), and the shipped tile writing every matrix's amax (the
FP8 weights' kept amax, fp8.weight_amax) against the same tile without. Writes adamw.json to --out.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import cuda_event_ms, env_info, write_json


def model_param_shapes(spec: str) -> list[torch.Size]:
    from models.registry import build_model

    name, _, layers = spec.partition(":")
    model = build_model(name, device="meta", overrides={"n_layers": int(layers)} if layers else {})
    return [p.shape for p in model.parameters()]


def make_params(shapes, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.float32, generator=g).mul_(0.02)
                                 .to(dtype)) for s in shapes]
    return params


def set_grads(params, seed):
    g = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, device=p.device, dtype=torch.float32, generator=g).to(p.dtype)


def grad_norm(params):
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params], 2.0)).float())


def run_case(shapes, dtype, args, device) -> dict:
    from optim import ChunkedAdamW, adamw
    kw = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
    numel = sum(s.numel() for s in shapes)
    esize = torch.empty((), dtype=dtype).element_size()
    moved = numel * esize * 7  # read p, g, m, v; write p, m, v (grad not written by either)
    out = {"dtype": str(dtype).replace("torch.", ""), "params": len(shapes), "numel": numel, "bytes_per_step": moved}

    # Correctness: identical params, grads and steps through both; clip active (max_norm below the norm).
    p_t = make_params(shapes, dtype, device, 1)
    p_o = [torch.nn.Parameter(p.detach().clone()) for p in p_t]
    opt_t = torch.optim.AdamW(p_t, fused=True, **kw)
    opt_o = ChunkedAdamW(p_o, fused=True, **kw)
    start = [p.detach().clone() for p in p_t]
    for i in range(args.check_steps):
        set_grads(p_t, 100 + i)
        set_grads(p_o, 100 + i)
        n = grad_norm(p_t)
        max_norm = float(n) * 0.5
        torch.nn.utils.clip_grads_with_norm_(p_t, max_norm, n)
        opt_t.step()
        opt_o.clip_and_step(n, max_norm)
    change = max((a.float() - s.float()).abs().max().item() for a, s in zip(p_t, start))
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(p_t, p_o))
    out["kernel_steps"] = opt_o.kernel_steps
    out["max_param_change"] = change
    out["max_diff_torch_vs_ours"] = diff
    out["max_diff_over_change"] = diff / change if change else None
    del p_t, p_o, opt_t, opt_o, start
    torch.cuda.empty_cache()

    # Timing: one set of params per implementation, grads set once (both read them, neither changes them).
    params = make_params(shapes, dtype, device, 2)
    set_grads(params, 3)
    n = grad_norm(params)
    torch_opt = torch.optim.AdamW(params, fused=True, **kw)

    def torch_step():
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, n)
        torch_opt.step()

    for _ in range(3):
        torch_step()
    out["torch_fused_clip_ms"] = cuda_event_ms(torch_step, args.reps)
    out["torch_fused_ms"] = cuda_event_ms(torch_opt.step, args.reps)
    torch_opt.state.clear()  # its exp_avg / exp_avg_sq, before ours allocates its own
    torch.cuda.empty_cache()
    tiles = {}
    shipped = (adamw.BLOCK, adamw.NUM_WARPS, adamw.HINT_POINTERS)
    for block, warps, hint in [(b, w, h) for h in args.hints for b in args.blocks for w in args.warps]:
        adamw.BLOCK, adamw.NUM_WARPS, adamw.HINT_POINTERS = block, warps, hint == "pointer"
        ours = ChunkedAdamW(params, fused=True, **kw)
        for _ in range(3):
            ours.clip_and_step(n, 1.0)
        tiles[f"block{block}_warps{warps}_hint-{hint}"] = cuda_event_ms(lambda opt=ours: opt.clip_and_step(n, 1.0),
                                                                   args.reps)
        ptx = ours.last_compiled.asm.get("ptx", "") if ours.last_compiled is not None else ""
        # Vector loads are what the unmasked whole-chunk path is for (none: scalar 2- or 4-byte accesses).
        out.setdefault(f"ptx_vector_loads_hint-{hint}", len(re.findall(r"ld\.global\S*\.v[248]", ptx)))
        out.setdefault(f"ptx_loads_hint-{hint}", len(re.findall(r"ld\.global", ptx)))
        ours.state.clear()
        torch.cuda.empty_cache()
    adamw.BLOCK, adamw.NUM_WARPS, adamw.HINT_POINTERS = shipped
    # The shipped tile writing every matrix's amax as the worker has it write its FP8 weights' (fp8.weight_amax): one
    # partial per chunk and a second launch; what that costs against the same step without it.
    holders = [SimpleNamespace(weight=p, weight_amax=torch.zeros((), device=device)) for p in params if p.dim() == 2]
    ours = ChunkedAdamW(params, fused=True, **kw)
    ours.keep_weight_amax(holders)
    for _ in range(3):
        ours.clip_and_step(n, 1.0)
    out["ours_clip_kept_amax_ms"] = cuda_event_ms(lambda opt=ours: opt.clip_and_step(n, 1.0), args.reps)
    out["kept_amax_matrices"] = len(holders)
    out["kept_amax_exact"] = all(torch.equal(h.weight_amax, h.weight.detach().abs().amax().float()) for h in holders)
    out["ours_clip_shipped_tile_ms"] = tiles.get(f"block{shipped[0]}_warps{shipped[1]}_hint-"
                                                 f"{'pointer' if shipped[2] else 'none'}")  # (None: not swept)
    ours.state.clear()
    del ours, holders
    torch.cuda.empty_cache()
    out["ours_clip_ms_by_tile"] = tiles
    best = min(tiles.values())
    out["best_tile"] = min(tiles, key=tiles.get)
    out["ours_clip_ms"] = best
    out["torch_TBps"] = moved / out["torch_fused_ms"] / 1e9
    out["ours_TBps"] = moved / best / 1e9
    out["speedup_with_clip"] = out["torch_fused_clip_ms"] / best
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--models", nargs="*", default=["llama3_8b:8", "deepseek_moe16b:4"])
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--blocks", nargs="*", type=int, default=[1024, 512, 2048])
    ap.add_argument("--warps", nargs="*", type=int, default=[4, 2, 8])
    ap.add_argument("--hints", nargs="*", default=["pointer", "none"], choices=("pointer", "none"),
                    help="16-byte alignment stated on the pointers, or no hint (optim.adamw.HINT_POINTERS); a hint "
                         "on the integer address before the cast reached no load (0 vector loads in the PTX)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--check-steps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda")
    result = {"env": env_info(), "command": "python3 " + " ".join(sys.argv), "cases": []}
    for spec in args.models:
        shapes = model_param_shapes(spec)
        for dt in args.dtypes:
            rec = {"model": spec}
            try:
                rec.update(run_case(shapes, getattr(torch, dt), args, device))
            except Exception as exc:  # noqa: BLE001  # record, go on with the other cases
                rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
            result["cases"].append(rec)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
            torch.cuda.empty_cache()
    write_json(os.path.join(args.out, "adamw.json"), result)


if __name__ == "__main__":
    main()
