#!/bin/bash
# Session 8, device call B (one H200, call A's warm machine when it held): the end-to-end rows with the final code.
# MoE: ours (compiled grouped-op bodies), bf16, ours with CUDA graphs (+cg: never run with compiled bodies, whose
# capture path falls back to eager bodies), torchao's MoE recipe. Dense: ours first (cold-cache ordering made calls
# 7C/7D's fp8 rows swing), then bf16 and torchao.
# Run from the repo root on the device: bash benchmarks/scripts/session8_b.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/dense
timeout 290 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only ours:rowwise,bf16,ours:rowwise+cg,torchao:moe --steps 12 --warmup 3 --budget-s 230 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error" $OUT/moe/log.txt | cut -c1-200 | head -8
timeout 280 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only ours:tensorwise,ours:rowwise,bf16,torchao:tensorwise --steps 8 --warmup 3 --budget-s 220 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error" $OUT/dense/log.txt | cut -c1-200 | head -8
