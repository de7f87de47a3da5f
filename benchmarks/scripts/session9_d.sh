#!/bin/bash
# Session 9, device call D (one H200): both configs at twice the depth (dense 16 layers instead of 8, MoE 8 instead
# of 4). Call C's profile of the 8-layer dense step puts ~87 ms of both sides in parts FP8 does not touch (bf16
# output head ~32 ms, attention ~32, AdamW ~23); the head is fixed per model while the layers scale, so the ratio
# should move with depth toward the per-layer ratio. This checks that projection.
# Run from the repo root on the device: bash benchmarks/scripts/session9_d.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/dense16 $OUT/moe8
timeout 230 python3 benchmarks/train_step.py --out $OUT/dense16 --configs dense --dense-layers 16 \
  --only ours:tensorwise,bf16 --steps 6 --warmup 3 --budget-s 160 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense16/log.txt
grep -E "tok/s|ERROR|Error|memory" $OUT/dense16/log.txt | cut -c1-200 | head -6
timeout 200 python3 benchmarks/train_step.py --out $OUT/moe8 --configs moe --moe-layers 8 \
  --only ours:rowwise,bf16 --steps 8 --warmup 3 --budget-s 130 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe8/log.txt
grep -E "tok/s|ERROR|Error|memory" $OUT/moe8/log.txt | cut -c1-200 | head -6
