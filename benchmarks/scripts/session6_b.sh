#!/bin/bash
# Session 6, device call B (one H200): call A showed the FP8 MoE step's idle comes and goes between steps
# (8 steps: min 118.9 ms ~ GPU busy, median 134.0) while GC pauses are ~0.1 ms per step, so: per-step times and a
# 6-step host profile naming the host op running at the end of each large GPU gap; then benchmarks/moe_grouped.py's
# compiled rows (not measured since the grouped GEMM became opaque custom ops).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/b
timeout 230 python3 benchmarks/train_step.py --out $OUT/b --configs moe --only ours:rowwise,bf16 \
  --steps 12 --warmup 2 --host-profile --budget-s 200 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/b/moe_log.txt
grep -E "gap|idle|syncs|ms/step.*(elastic|cuda|Call)|tok/s" $OUT/b/moe_log.txt | cut -c1-400 | head -40
timeout 200 python3 benchmarks/moe_grouped.py --out $OUT/b --cases bf16_compiled ours_hp_compiled ours_compiled \
  torchao_compiled --budget-s 170 2>&1 | grep -v "Warning\|warn" > $OUT/b/moe_grouped_log.txt
tail -15 $OUT/b/moe_grouped_log.txt
