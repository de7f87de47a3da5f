#!/bin/bash
# Session 7, device call E (one H200, the warm machine of call D, its compile caches filled): the dense rows again with
# ours first, after calls C and D's default tensorwise rows (ran right after bf16 on cold caches) swung 207-269 ms.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT/dense2
timeout 150 python3 benchmarks/train_step.py --out $OUT/dense2 --configs dense \
  --only ours:tensorwise,ours:tensorwise+minw1000,bf16 --steps 8 --warmup 2 --budget-s 100 2>&1 | grep -E "tok/s|ERROR"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv
