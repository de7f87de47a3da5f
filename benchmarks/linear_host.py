"""Host (CPU) time vs GPU time of one compiled FP8 linear's forward + backward, and of one Triton launch.

    PYTHONUNBUFFERED=1 python3 benchmarks/linear_host.py --out $OUT [--shapes llama3_8b.wo llama3_8b.wk]

Why: session 8's fp8_linear.py kernel tables showed ours compiled at Llama3-8B wo with less GPU time than torchao
(0.765 vs 0.782 ms of kernels per forward + backward) but a longer wall time (1.626 vs 1.207 ms): host-bound. This
separates the two for each variant, and times one launch of our transpose kernel three ways (eager Python launch,
launched by Inductor's generated code inside a compiled function, and Inductor's own transpose) to price what a
user-defined Triton kernel costs the host inside a compiled graph.

Per case: host us per call (GPU put to sleep first, so calls only enqueue: grouped_host.host_us), wall ms per call
(triton do_bench, what fp8_linear.py reports) and GPU ms per call (sum of kernel times, torch.profiler).
Variants: bf16; torchao tensorwise; ours tensorwise with the transposes as our kernel (default) and written by
Inductor (FP8_KERNELS=no_transposes); ours rowwise with our cast kernels (default) and with every cast traced from
the references (FP8_KERNELS=0). Writes linear_host.json to --out.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch._dynamo
import torch._inductor.config

from fp8.backend import fp8_dtypes

torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.accumulated_recompile_limit = 4096

from benchmarks.common import bench_ms, env_info, write_json
from benchmarks.fp8_linear import SHAPES, build, kernel_table, make_step
from benchmarks.grouped_host import host_us

# (label, impl, recipe, FP8_KERNELS value, health statistics on, Inductor's static launcher for user Triton kernels)
VARIANTS = (
    ("bf16", "bf16", "-", "1", True, False),
    ("torchao tensorwise", "torchao", "tensorwise", "1", True, False),
    ("ours tensorwise (transpose kernel)", "ours_compiled", "tensorwise", "1", True, False),
    # Session 15: the same compiled with static_launch_user_defined_triton_kernels (session 14 call G cut its host
    # time 1384 -> 1233 us at wo in a fresh process; timed here beside torchao in one process).
    ("ours tensorwise (static launcher)", "ours_compiled", "tensorwise", "1", True, True),
    ("ours tensorwise (Inductor transposes)", "ours_compiled", "tensorwise", "no_transposes", True, False),
    # Probe only (session 14): the health statistics replaced by a constant, to price them on the host.
    ("ours tensorwise (no health stats)", "ours_compiled", "tensorwise", "1", False, False),
    ("ours rowwise (cast kernels)", "ours_compiled", "rowwise", "1", True, False),
    ("ours rowwise (static launcher)", "ours_compiled", "rowwise", "1", True, True),
    ("ours rowwise (casts traced)", "ours_compiled", "rowwise", "0", True, False),
)


def set_health_stats(on: bool) -> None:
    """Probe switch: fp8.linear's health statistics as they are, or a constant (what they cost per call)."""
    from fp8 import linear

    if not hasattr(linear, "_health_stats_real"):
        linear._health_stats_real = linear.health_stats
    linear.health_stats = linear._health_stats_real if on else (
        lambda x_hp, x_fp8, scale, dtype: torch.zeros(3, dtype=torch.float32, device=x_hp.device))


def set_kernels_env(value: str) -> None:
    """FP8_KERNELS for the next compile; fp8.quant caches its kernels lookup, so forget it too."""
    from fp8 import quant

    os.environ["FP8_KERNELS"] = value
    quant._KERNELS_LOOKED_UP = False
    quant._FAILED.clear()  # a kernel that failed under one variant is tried again under the next
    # Look it up again now, eagerly, as convert_to_fp8 does (session 8's run reset it without this, and every ours
    # row measured a graph-broken layer: see fp8.quant._kernels).
    quant.look_up_kernels_eagerly()
    torch._dynamo.reset()


def launch_costs(calls: int, repeats: int) -> dict:
    """Host us of one fp8 transpose (8192 x 4096): eager Triton launch, Inductor-launched user kernel, Inductor's own."""
    from fp8 import quant
    from fp8.kernels.quantize import transpose_triton

    set_kernels_env("1")
    x = torch.randn(8192, 4096, device="cuda").to(fp8_dtypes("cuda")[0])
    ours_in_graph = torch.compile(lambda t: quant.transposed_copy(t), dynamic=False)
    inductor_own = torch.compile(lambda t: t.t().contiguous(), dynamic=False)
    empty_graph = torch.compile(lambda t: t.view(-1)[:1], dynamic=False)
    out = {}
    for name, fn in (("eager Triton launch (transpose_triton)", lambda: transpose_triton(x)),
                     ("our kernel launched by Inductor (compiled fn)", lambda: ours_in_graph(x)),
                     ("Inductor's own transpose (compiled fn)", lambda: inductor_own(x)),
                     ("compiled fn, one view (dynamo + wrapper floor)", lambda: empty_graph(x)),
                     ("torch op (x.t().contiguous())", lambda: x.t().contiguous())):
        out[name] = host_us(fn, calls, repeats)
        print(f"  {out[name]:8.1f} us host  {name}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--shapes", nargs="*", default=["llama3_8b.wo", "llama3_8b.wk"])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", nargs="*", default=None,
                   help="labels (substrings) of the variants to run, in this order; default all")
    args = p.parse_args()
    variants = VARIANTS if not args.variants else [
        v for want in args.variants for v in VARIANTS if want in v[0]]
    result = {"env": env_info(), "m": args.m, "launch_host_us": launch_costs(args.calls * 2, args.repeats),
              "cases": []}
    for shape in args.shapes:
        k, n = SHAPES[shape]
        for label, impl, recipe, kernels, health, static in variants:
            rec = {"shape": shape, "variant": label, "FP8_KERNELS": kernels, "static_launch_user_kernels": static}
            try:
                set_kernels_env(kernels)
                set_health_stats(health)
                step = make_step(build(impl, recipe, k, n, "cuda"), args.m, k, n, "cuda")
                # The option is read when Inductor writes the wrapper code, i.e. during the first (compiling) call.
                with torch._inductor.config.patch(static_launch_user_defined_triton_kernels=static):
                    step()
                torch.cuda.synchronize()
                rec["host_us"] = host_us(step, args.calls, args.repeats)
                rec["wall_ms"] = bench_ms(step)
                kernels_rows = kernel_table(step)
                rec["gpu_ms"] = sum(r["us_per_step"] for r in kernels_rows) / 1e3
                rec["kernel_launches"] = sum(r["calls_per_step"] for r in kernels_rows)
                rec["kernels"] = kernels_rows[:12]
            except Exception as e:  # noqa: BLE001  # record, go on with the other variants
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            result["cases"].append(rec)
            print(f"{shape:14s} {label:40s} host {rec.get('host_us', float('nan')):8.1f} us  wall "
                  f"{rec.get('wall_ms', float('nan')):7.3f} ms  GPU {rec.get('gpu_ms', float('nan')):7.3f} ms  "
                  f"launches {rec.get('kernel_launches', 0):5.1f} {rec.get('error', '')}", flush=True)
    set_kernels_env("1")
    result["command"] = "python3 " + " ".join(sys.argv)
    write_json(os.path.join(args.out, "linear_host.json"), result)


if __name__ == "__main__":
    main()
