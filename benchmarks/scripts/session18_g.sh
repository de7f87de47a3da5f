#!/bin/bash
# Session 18, call G (as run; carry .whl for torchao): dense 8 layers, bf16 vs ours tensorwise + fused FP8 head vs ours
# rowwise vs torchao tensorwise + head, our AdamW on every row, in one run.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT/dense
timeout 200 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:rowwise+tadam,torchao:tensorwise+head+tadam --steps 8 --warmup 3 \
  --budget-s 150 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -10
