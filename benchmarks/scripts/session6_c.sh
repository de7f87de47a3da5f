#!/bin/bash
# Session 6, device call C (one H200): the end-to-end rows with this session's defaults (the worker's scheduled GC
# in the timed steps), 12 steps each for a steadier median: MoE first (ours vs bf16 vs torchao), then dense.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/dense
timeout 220 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --only bf16,ours:rowwise,torchao:moe \
  --steps 12 --warmup 2 --profile --budget-s 190 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
tail -5 $OUT/moe/log.txt
timeout 330 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16,ours:tensorwise,torchao:tensorwise,ours:rowwise,torchao:rowwise \
  --steps 12 --warmup 2 --profile --budget-s 300 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
tail -7 $OUT/dense/log.txt
