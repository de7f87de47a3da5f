"""Host (CPU) time of the FP8 grouped GEMM's op bodies, piece by piece, at DeepSeek-MoE-16B shapes.

    PYTHONUNBUFFERED=1 python3 benchmarks/grouped_host.py --out $OUT [--calls 20] [--repeats 7]

Why: in a compiled training step the MoE blocks' FP8 grouped GEMMs are opaque custom ops whose bodies run eagerly
(fp8/grouped.py); on a slow host the GPU waits for them (BENCHMARKS.md, end-to-end section). This measures what
each piece costs the host, so that host-time work is steered by numbers rather than launch counts.

Host time of a piece: the GPU is first put to sleep (torch.cuda._sleep), then `--calls` calls are issued and timed
with perf_counter; they only enqueue work, so the wall time is the host's (median of `--repeats`). GPU time of a
piece: CUDA events around `--calls` calls. Both per call, in microseconds. Pieces: the whole forward op (the custom
op, as the compiled block calls it), the whole forward + backward through autograd, and the forward body's parts:
the row cast of x, the weight cast, the reciprocal scales, the fp8 grouped GEMM, the health statistics (torch
reference vs the one-launch kernel), and a bf16 torch._grouped_mm and an empty torch op for scale. The whole op is
timed with its body compiled (fp8.grouped's default on CUDA) and eager (FP8_GROUPED_BODY=eager).
Also checks the health kernel against the reference on the GPU (bit-equal). Writes grouped_host.json to --out.

Legend: M routed rows, D model dim, I expert hidden dim, E experts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import env_info, write_json
from benchmarks.moe_grouped import add_shape_args, group_offsets
from fp8.backend import fp8_dtypes


def host_us(fn, calls: int, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda._sleep(int(3e8))  # ~0.15 s of GPU sleep: every call below only enqueues
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_us(fn, calls: int, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser()
    add_shape_args(p)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()

    from fp8 import quant
    from fp8.grouped import Fp8GroupedMM, _grouped_fwd_op
    from fp8.kernels import health_stats as health_kernel_or_ref
    from fp8.kernels.reference import health_stats_ref

    dev = "cuda"
    M, D, I, E = args.m, args.dim, args.hidden, args.experts
    e4m3 = fp8_dtypes(dev)[0]  # e4m3fnuz (max 240) on MI300, e4m3fn elsewhere
    gen = torch.Generator(device=dev).manual_seed(0)
    x_MD = torch.randn(M, D, device=dev, dtype=torch.bfloat16, generator=gen)
    w13_EJD = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16, generator=gen) * D**-0.5
    w13_EDJ = w13_EJD.transpose(-2, -1)  # the column-major [E, K, N] view the models pass
    offs = group_offsets(M, E, 16, dev)
    gy_MJ = torch.randn(M, 2 * I, device=dev, dtype=torch.bfloat16, generator=gen)

    x_fp8, sx_M1 = quant.quantize_rowwise(x_MD, e4m3, -1, True)
    w_fp8, sw_E1N = quant.quantize_colwise_3d(w13_EDJ, e4m3, True)
    inv_x, inv_w = torch._foreach_reciprocal([sx_M1, sw_E1N])

    # Correctness of the kernel on the GPU first: the same bits as the reference on the real operands.
    checks = {}
    got = health_kernel_or_ref(x_MD, x_fp8, sx_M1, e4m3)
    want = health_stats_ref(x_MD, x_fp8, sx_M1, e4m3)
    checks["health_rowwise_equal"] = bool(torch.equal(got, want))
    stale = sx_M1 * 256  # clipping: the saturated fraction must be counted the same way
    e4m3_max = torch.finfo(e4m3).max
    x_clip = (x_MD.float() * stale).clamp(-e4m3_max, e4m3_max).to(e4m3)
    checks["health_clipped_equal"] = bool(torch.equal(health_kernel_or_ref(x_MD, x_clip, stale, e4m3),
                                                      health_stats_ref(x_MD, x_clip, stale, e4m3)))
    checks["health_clipped_values"] = health_stats_ref(x_MD, x_clip, stale, e4m3).tolist()
    print("checks:", checks, flush=True)

    fwd_args = (x_MD, w13_EDJ, offs, e4m3, True, True, "hp", False)
    mm = Fp8GroupedMM(mode="opaque")
    x_req = x_MD.detach().clone().requires_grad_()
    w_req = w13_EJD.detach().clone().requires_grad_()

    def fwd_bwd():
        out = mm(x_req, w_req.transpose(-2, -1), offs)
        out.backward(gy_MJ)
        x_req.grad = None
        w_req.grad = None

    empty = torch.empty(1, device=dev)
    pieces = {
        "forward op, compiled body (the default on CUDA)": lambda: _grouped_fwd_op(*fwd_args),
        "forward + backward, compiled bodies (dgrad fp8, wgrad bf16)": fwd_bwd,
        "row cast of x (Triton)": lambda: quant.quantize_rowwise(x_MD, e4m3, -1, True),
        "weight cast w13 (Triton)": lambda: quant.quantize_colwise_3d(w13_EDJ, e4m3, True),
        "reciprocal scales (one foreach launch)": lambda: torch._foreach_reciprocal([sx_M1, sw_E1N]),
        "reciprocal scales (two launches, before)": lambda: (sx_M1.reciprocal(), sw_E1N.reciprocal()),
        "fp8 grouped GEMM (torch._scaled_grouped_mm)": lambda: torch._scaled_grouped_mm(
            x_fp8, w_fp8, inv_x.reshape(-1), inv_w.reshape(E, -1), offs, out_dtype=torch.bfloat16,
            use_fast_accum=True),
        "health stats, torch reference": lambda: health_stats_ref(x_MD, x_fp8, sx_M1, e4m3),
        "health stats, one Triton launch": lambda: health_kernel_or_ref(x_MD, x_fp8, sx_M1, e4m3),
        "bf16 grouped GEMM (torch._grouped_mm)": lambda: torch._grouped_mm(x_MD, w13_EDJ, offs=offs),
        "empty torch op (x.add_(0) on 1 element)": lambda: empty.add_(0),
    }
    rows = []
    variants = (("FP8_GROUPED_BODY", "eager", "forward op, eager body (FP8_GROUPED_BODY=eager)"),
                ("FP8_GROUPED_BODY", "eager", "forward + backward, eager bodies"),
                ("FP8_KERNELS", "always", "forward op, eager body, health by the one-launch kernel (FP8_KERNELS=always)"))
    for env, value, label in variants:
        os.environ[env] = value
        if value == "always":
            os.environ["FP8_GROUPED_BODY"] = "eager"
        fn = fwd_bwd if "backward" in label else (lambda: _grouped_fwd_op(*fwd_args))
        rows.append({"piece": label, "host_us": host_us(fn, args.calls, args.repeats),
                     "gpu_us": gpu_us(fn, args.calls, args.repeats)})
        os.environ.pop(env)
        os.environ.pop("FP8_GROUPED_BODY", None)
    for name, fn in pieces.items():
        rows.append({"piece": name, "host_us": host_us(fn, args.calls, args.repeats),
                     "gpu_us": gpu_us(fn, args.calls, args.repeats)})
    print(f"{'piece':62s} {'host us':>9s} {'GPU us':>9s}")
    for r in rows:
        print(f"{r['piece']:62s} {r['host_us']:9.1f} {r['gpu_us']:9.1f}")
    write_json(os.path.join(args.out, "grouped_host.json"), {
        "command": "python3 " + " ".join(sys.argv), "env": env_info(), "shape": {"M": M, "D": D, "I": I, "E": E},
        "checks": checks, "rows": rows,
    })


if __name__ == "__main__":
    main()
