#!/bin/bash
# Session 4, device call B (one H200): the dense training step, all recipes against bf16 and torchao in one run.
# (Flags as of session 4; since then "+tk" is the default (use "+ntk" for the old behaviour).)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/b
timeout 560 python3 benchmarks/train_step.py --out $OUT/b --configs dense \
  --only bf16,ours:tensorwise+tk,ours:tensorwise,torchao:tensorwise,ours:rowwise,torchao:rowwise \
  --steps 5 --warmup 2 --profile --budget-s 470 2>&1 | grep -v "optimizer probe" | tail -60
