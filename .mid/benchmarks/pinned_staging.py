"""How to get a checkpoint's pinned host buffers without stopping training (GPU host; probe for
orchestration.checkpoint.manager's staging buffers).

    PYTHONUNBUFFERED=1 python3 benchmarks/pinned_staging.py --out $OUT [--gib 13]

Why: with torch.empty(pin_memory=True) (cudaHostAlloc through torch's caching host allocator) the first background
save stalled training for 7.7-8.6 s, pinning the host buffers for 13 GB. Every restart of a process
pays it again. This measures, for buffers shaped like a checkpoint (a few GiB-sized tensors and many small ones):
- the time to get pinned buffers two ways: "host_alloc" (torch.empty(pin_memory=True)) and "register" (pageable
  torch.empty, pages touched by torch's multithreaded fill, then cudaHostRegister of each buffer's exact bytes),
  and the bytes the caching allocator really pinned (it rounds blocks up to powers of two);
- what either does to a training-like GPU loop (bf16 matmuls launched from the main thread) when it runs in a
  background thread at the same time: loop time against the same loop alone, and the slowest single launch call
  (a driver lock held by the pinning thread shows up there);
- device-to-host copy bandwidth into each kind of buffer, the host time of the non_blocking copy call, and whether
  torch sees registered memory as pinned.
Writes pinned_staging.json to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import env_info, write_json

GIB = 1 << 30


def checkpoint_like_sizes(total_gib: float) -> list[int]:
    """Byte sizes: 90% in 1 GiB tensors (expert weights, their optimizer moments), the rest in 64 tensors of equal
    size (norms, attention projections)."""
    big = int(total_gib * 0.9)
    small_total = int(total_gib * GIB) - big * GIB
    return [GIB] * big + [small_total // 64] * 64


def pinned_host_alloc(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]


def pinned_register(sizes: list[int], touch: bool = True) -> tuple[list[torch.Tensor], dict]:
    """Pageable buffers, pages faulted in by a multithreaded fill, then page-locked with cudaHostRegister."""
    cudart = torch.cuda.cudart()
    bufs, t_touch, t_reg = [], 0.0, 0.0
    for n in sizes:
        buf = torch.empty(n, dtype=torch.uint8)
        t0 = time.perf_counter()
        if touch:
            buf.zero_()
        t1 = time.perf_counter()
        err = cudart.cudaHostRegister(buf.data_ptr(), n, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        t2 = time.perf_counter()
        t_touch += t1 - t0
        t_reg += t2 - t1
        bufs.append(buf)
    return bufs, {"touch_s": round(t_touch, 3), "register_s": round(t_reg, 3)}


def unregister(bufs: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for b in bufs:
        cudart.cudaHostUnregister(b.data_ptr())


def gpu_loop(iters: int, a: torch.Tensor, b: torch.Tensor) -> dict:
    """bf16 matmuls with a sync every 8 (a training step's queue depth): loop seconds, slowest launch call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    worst = 0.0
    for i in range(iters):
        s = time.perf_counter()
        torch.mm(a, b)
        worst = max(worst, time.perf_counter() - s)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {"loop_s": round(time.perf_counter() - t0, 3), "worst_launch_ms": round(worst * 1e3, 3)}


def loop_beside(method: str, sizes: list[int], iters: int, a, b) -> dict:
    """The GPU loop while a thread gets pinned buffers by `method`."""
    out: dict = {}

    def work():
        t0 = time.perf_counter()
        if method == "host_alloc":
            bufs = pinned_host_alloc(sizes)
        else:
            bufs, detail = pinned_register(sizes)
            out.update(detail)
        out["pin_s"] = round(time.perf_counter() - t0, 3)
        out["bufs"] = bufs

    th = threading.Thread(target=work)
    th.start()
    time.sleep(0.05)
    loop = gpu_loop(iters, a, b)
    th.join()
    out.update({f"beside_{k}": v for k, v in loop.items()})
    return out


def copy_into(buf_kind: str, host: torch.Tensor, src: torch.Tensor) -> dict:
    torch.cuda.synchronize()
    host.copy_(src, non_blocking=True)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(src, non_blocking=True)
    t_call = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_all = time.perf_counter() - t0
    return {"buffer": buf_kind, "is_pinned": bool(host.is_pinned()), "call_ms": round(t_call * 1e3, 3),
            "GB_per_s": round(src.numel() / t_all / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--gib", type=float, default=13.0)
    p.add_argument("--iters", type=int, default=3000)
    args = p.parse_args()
    sizes = checkpoint_like_sizes(args.gib)
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    gpu_loop(50, a, b)
    result: dict = {"env": env_info(), "gib": args.gib, "n_tensors": len(sizes)}

    alone = gpu_loop(args.iters, a, b)
    result["loop_alone"] = alone
    print("loop alone", alone)

    for method in ("host_alloc", "register"):
        r = loop_beside(method, sizes, args.iters, a, b)
        bufs = r.pop("bufs")
        if method == "host_alloc":
            stats = torch.cuda.memory.host_memory_stats()
            r["pinned_bytes_gib"] = round(stats.get("allocated_bytes.current", 0) / GIB, 2)
        r["slowdown"] = round(r["beside_loop_s"] / alone["loop_s"], 3)
        print(method, r)
        result[method] = r
        src = torch.empty(GIB, dtype=torch.uint8, device=dev)
        result.setdefault("copies", []).append(copy_into(method, bufs[0], src))
        if method == "register":
            unregister(bufs)
        del bufs, src
        if method == "host_alloc":
            torch.cuda.memory.empty_host_cache() if hasattr(torch.cuda.memory, "empty_host_cache") else None

    # The same pinning with nothing else running, for its own speed; and without the touch (the driver faults).
    t0 = time.perf_counter()
    bufs, detail = pinned_register(sizes)
    result["register_alone"] = {"pin_s": round(time.perf_counter() - t0, 3), **detail}
    unregister(bufs)
    del bufs
    t0 = time.perf_counter()
    bufs, detail = pinned_register(sizes[:4], touch=False)
    result["register_untouched_4gib"] = {"pin_s": round(time.perf_counter() - t0, 3), **detail}
    unregister(bufs)
    del bufs
    pageable = torch.empty(GIB, dtype=torch.uint8)
    pageable.zero_()
    result["copies"].append(copy_into("pageable", pageable, torch.empty(GIB, dtype=torch.uint8, device=dev)))
    for k in ("register_alone", "register_untouched_4gib", "copies"):
        print(k, result[k])
    write_json(os.path.join(args.out, "pinned_staging.json"), result)


if __name__ == "__main__":
    main()
