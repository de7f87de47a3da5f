"""Tile sweeps of the Triton casts the MoE step runs most, alone on one GPU, each tile checked against the shipped one.

    PYTHONUNBUFFERED=1 python3 benchmarks/tile_sweeps.py --out $OUT [--sections rowcast,group,recast,transpose]

Shapes: DeepSeek-MoE-16B routed experts at 16384 tokens x top-6 (98304 rows, 64 experts): the gradients of w13's
output (98304 x 2816) and of w2's (98304 x 2048), and w2's input width (1408); the weights w13 [64, 2816, 2048] and
w2 [64, 2048, 1408] as stored ([E, N, K]). Rows (ms per call, 10 calls in one CUDA graph, median of the replays;
GB/s against each op's least traffic):
- rowcast: a copy of the gradient (bandwidth yardstick) and the plain row cast (quantize_rowwise) over tile budgets
  and warps;
- group: the gradient's group-scaled row cast of fp8.grouped's grad input, with fp32 multipliers and with bf16 ones
  (exact for powers of two: must give the same bytes), over tile budgets and warps. In a profiled MoE step it took
  0.30 ms a call against ~0.17 for the plain row cast of the same tensors;
- recast: the expert weight cast by the forward's row scales into the grad-input layout
  (cast_rows_transposed_batched), over tiles and warps (0.19 ms a call in that profile);
- transpose: the fp8 transpose of the tensorwise linears' backward operands (87 calls, 2.52 ms of that profile) at
  the MoE model's activation and weight shapes, next to a copy of the same bytes.
Writes tile_sweeps.json to --out.
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
    ap.add_argument("--reps", type=int, default=9)
    all_sections = ("rowcast", "group", "recast", "transpose")
    ap.add_argument("--sections", default=",".join(all_sections), help=f"comma-separated subset of {all_sections}")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - set(all_sections)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; choose from {all_sections}")
    from fp8.kernels import quantize as q
    from fp8.kernels import transposed as t

    e4m3 = torch.float8_e4m3fn
    E, M = 64, 98304
    g = torch.Generator(device="cuda").manual_seed(0)
    # expert groups of slightly uneven sizes, sorted by expert
    sizes = torch.full((E,), M // E, dtype=torch.int64)
    sizes[: E // 2] += 16
    sizes[E // 2:] -= 16
    gid = torch.repeat_interleave(torch.arange(E, device="cuda", dtype=torch.int32), sizes.cuda())
    rows = []

    def row(name, fn, traffic_bytes):
        bandwidth_row(rows, name, fn, traffic_bytes, args.reps, width=72)

    shipped = (q.ROWWISE_MAX_TILE, q.ROWWISE_MAX_ROW, q.ROWWISE_WARPS)
    for N in (2816, 2048, 1408) if sections & {"rowcast", "group"} else ():
        gy = torch.randn(M, N, device="cuda", generator=g).bfloat16()
        # powers of two, as the forward's row scales' reciprocals are
        mul32 = torch.exp2(torch.randint(-6, 7, (E, N), device="cuda", generator=g).float())
        mul16 = mul32.bfloat16()
        nbytes = gy.numel() * 2
        row(f"copy gy {M}x{N}", lambda gy=gy: gy.clone(), 2 * nbytes)
        row(f"row cast gy {M}x{N} (shipped tiles)", lambda gy=gy: q.quantize_rowwise_triton(gy, e4m3), nbytes * 3 // 2)
        # The plain row cast too (the MoE step's forward and grad-output casts, 12 a step): tile budget and warps.
        # max_row below the padded row: one row a program, looped over max_tile columns twice (amax, then the cast
        # re-reading the row from cache) instead of the padded row (4096 lanes for 2816) in registers.
        for max_tile, max_row, warps in ((4096, 16384, 4), (4096, 16384, 8), (16384, 16384, 8), (16384, 16384, 16),
                                         (2048, 16384, 4), (8192, 16384, 4), (1024, 1024, 4), (2048, 2048, 4),
                                         (1024, 1024, 2)) if "rowcast" in sections else ():
            q.ROWWISE_MAX_TILE, q.ROWWISE_MAX_ROW, q.ROWWISE_WARPS = max_tile, max_row, warps
            row(f"row cast {N} max_tile={max_tile} max_row={max_row} warps={warps}",
                lambda gy=gy: q.quantize_rowwise_triton(gy, e4m3), nbytes * 3 // 2)
        q.ROWWISE_MAX_TILE, q.ROWWISE_MAX_ROW, q.ROWWISE_WARPS = shipped
        if "group" not in sections:
            continue
        ref = q.quantize_rowwise_group_scaled_triton(gy, mul32, gid, e4m3)
        for max_tile, warps in ((8192, 8), (4096, 4), (4096, 8), (16384, 8), (16384, 16), (2048, 4)):
            q.ROWWISE_MAX_TILE, q.ROWWISE_WARPS = max_tile, warps
            for name, mul in (("fp32", mul32), ("bf16", mul16)):
                out = q.quantize_rowwise_group_scaled_triton(gy, mul, gid, e4m3)
                same = torch.equal(out[0].view(torch.int8), ref[0].view(torch.int8)) and torch.equal(out[1], ref[1])
                row(f"group-scaled {N} mul={name} max_tile={max_tile} warps={warps} same={same}",
                    lambda gy=gy, mul=mul: q.quantize_rowwise_group_scaled_triton(gy, mul, gid, e4m3), nbytes * 3 // 2)
        q.ROWWISE_MAX_TILE, q.ROWWISE_MAX_ROW, q.ROWWISE_WARPS = shipped

    tile_shipped, warps_shipped = t.BATCHED_ROW_CAST_TILE, t.TRANSPOSE_WARPS
    for N, K in ((2816, 2048), (2048, 1408)) if "recast" in sections else ():
        w_ENK = (torch.randn(E, N, K, device="cuda", generator=g) * 0.02).bfloat16()
        scale = torch.exp2(torch.randint(4, 12, (E, N), device="cuda", generator=g).float())
        ref = t.cast_rows_transposed_batched_triton(w_ENK, scale, e4m3)
        for tile, warps in (((64, 128), 4), ((32, 128), 4), ((64, 64), 4), ((128, 64), 4), ((64, 256), 8),
                            ((128, 128), 8), ((32, 256), 4)):
            t.BATCHED_ROW_CAST_TILE, t.TRANSPOSE_WARPS = tile, warps
            out = t.cast_rows_transposed_batched_triton(w_ENK, scale, e4m3)
            same = torch.equal(out.view(torch.int8), ref.view(torch.int8))
            row(f"recast w [{E},{N},{K}] tile={tile} warps={warps} same={same}",
                lambda w_ENK=w_ENK, scale=scale: t.cast_rows_transposed_batched_triton(w_ENK, scale, e4m3),
                w_ENK.numel() * 3)
        t.BATCHED_ROW_CAST_TILE, t.TRANSPOSE_WARPS = tile_shipped, warps_shipped
    # Activations [16384 tokens, width] (x and the output gradient of the MLA, shared-expert and dense-FFN linears of the
    # MoE 4-layer step) and weights [out, in]; every transpose moves 1 byte in and 1 out per element.
    transpose_shipped = (t.TRANSPOSE_TILE, t.TRANSPOSE_WARPS)
    for M, N in ((16384, 2048), (16384, 2816), (16384, 576), (16384, 10944), (3072, 2048), (2816, 2048)
                 ) if "transpose" in sections else ():
        x8 = torch.randn(M, N, device="cuda", generator=g).to(e4m3).view(torch.int8)
        ref = x8.t().contiguous()
        row(f"copy int8 {M}x{N}", lambda x8=x8: x8.clone(), 2 * x8.numel())
        for tile, warps in (((128, 128), 4), ((128, 128), 8), ((64, 128), 4), ((128, 64), 4), ((64, 64), 4),
                            ((256, 128), 8), ((128, 256), 8), ((64, 256), 4), ((256, 64), 4), ((32, 128), 2)):
            t.TRANSPOSE_TILE, t.TRANSPOSE_WARPS = tile, warps
            same = torch.equal(t.transpose_triton(x8), ref)
            row(f"transpose {M}x{N} tile={tile} warps={warps} same={same}", lambda x8=x8: t.transpose_triton(x8),
                2 * x8.numel())
        t.TRANSPOSE_TILE, t.TRANSPOSE_WARPS = transpose_shipped
    write_json(os.path.join(args.out, "tile_sweeps.json"),
               {"command": "python3 " + " ".join(sys.argv), "env": env_info(), "rows": rows})


if __name__ == "__main__":
    main()
