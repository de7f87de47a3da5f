#!/bin/bash
# Session 5, device call B (one H200): the dense training step with the new default (tensorwise's fp8 transposed
# copies as our kernel under compile), every recipe against bf16 and torchao in one run.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/b
timeout 560 python3 benchmarks/train_step.py --out $OUT/b --configs dense \
  --only bf16,ours:tensorwise,torchao:tensorwise,ours:rowwise,torchao:rowwise,ours:tensorwise+ntk \
  --steps 5 --warmup 2 --profile --budget-s 440 2>&1 | grep -v "optimizer probe" | tail -70
