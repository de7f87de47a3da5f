#!/bin/bash
# Session 10, device call E (one H200, right after D on the same machine): the same-run
# references call D lacked: torchao's MoE recipe and ours tensorwise without the FP8 head.
# Run from the repo root on the device: bash benchmarks/scripts/session10_e.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
timeout 250 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16,torchao:moe,ours:tensorwise --steps 8 --warmup 3 --budget-s 200 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|memory" $OUT/moe/log.txt | cut -c1-200 | head -8
