#!/bin/bash
# Session 10, device call C (one H200): (1) the full Llama3-8B depth (32 layers, fits one H200) with the FP8 output
# head, ours and torchao; (2) loss parity over 300 steps with a 65536-token vocabulary, with a second bf16 run from
# another initialisation as the yardstick for run-to-run drift (call B: the FP8 rows ended 0.7-1.7% below bf16).
# Run from the repo root on the device: bash benchmarks/scripts/session10_c.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/dense32 $OUT/loss
timeout 300 python3 benchmarks/train_step.py --out $OUT/dense32 --configs dense --dense-layers 32 \
  --only bf16,ours:tensorwise+head,torchao:tensorwise+head,ours:rowwise+head,ours:tensorwise --steps 6 --warmup 3 \
  --budget-s 230 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense32/log.txt
grep -E "tok/s|ERROR|Error|memory" $OUT/dense32/log.txt | cut -c1-200 | head -8
timeout 230 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-vocab pairs \
  --loss-variants bf16,bf16+seed1,ours:tensorwise,ours:tensorwise+head,ours:rowwise+head --loss-steps 300 2>&1 \
  | grep -v "Warning\|warn" > $OUT/loss/log.txt
grep -E "loss|ERROR|Error" $OUT/loss/log.txt | cut -c1-200 | head -12
