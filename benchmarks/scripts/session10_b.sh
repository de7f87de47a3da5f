#!/bin/bash
# Session 10, device call B (one H200): the FP8 output head (precision.fp8_output_head, "+head" rows). Call A's
# profile puts the bf16 head's three GEMMs at 32.7 ms of the 188.65 ms dense FP8 step: the largest single item
# left in bf16. (1) dense 8-layer step with and without it, ours and torchao, both recipes; (2) loss parity on real
# data with a 65536-token vocabulary (byte pairs), where an FP8 head's numerics would show.
# Run from the repo root on the device: bash benchmarks/scripts/session10_b.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/dense $OUT/loss
timeout 330 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16,ours:tensorwise+head,torchao:tensorwise+head,ours:tensorwise,ours:rowwise+head,torchao:rowwise+head \
  --steps 8 --warmup 3 --budget-s 270 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error" $OUT/dense/log.txt | cut -c1-200 | head -12
timeout 230 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-vocab pairs \
  --loss-variants bf16,ours:tensorwise,ours:tensorwise+head,ours:rowwise+head --loss-steps 150 2>&1 \
  | grep -v "Warning\|warn" > $OUT/loss/log.txt
grep -E "loss|ERROR|Error" $OUT/loss/log.txt | cut -c1-200 | head -12
