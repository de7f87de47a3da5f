#!/bin/bash
# Session 20, third call (what device time is left after session20_a and session20_b): loss parity over 300 steps
# (150-step runs of the same code gave +0.92 / +1.63 / +0.01 % vs bf16).
#   bash benchmarks/scripts/session20_c.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/loss
timeout 280 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-steps 300 --loss-vocab pairs \
  --loss-variants bf16,ours:tensorwise+head 2>&1 | grep -E "^\[loss\]|^loss|Error" | head -8
