#!/bin/bash
# Session 18, call F (as run, on the machine call E left warm): dense 8 layers, bf16 vs ours tensorwise + fused FP8
# head, both with our AdamW (ours with the optimizer step gated before the guard's host read).
export PYTHONUNBUFFERED=1; mkdir -p $OUT/dense
timeout 230 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --only bf16+tadam,ours:tensorwise+head+tadam \
  --steps 8 --warmup 3 --budget-s 150 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -8
