#!/bin/bash
# Session 9, device call E (one H200): kernel profile of the MoE step (4 layers), ours rowwise and bf16, with the
# kernels-lookup fix, for the where-time-goes bound (call D: the per-MoE-layer ratio is ~1.03x).
# Run from the repo root on the device: bash benchmarks/scripts/session9_e.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
timeout 200 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --only ours:rowwise,bf16 \
  --steps 6 --warmup 3 --profile --budget-s 130 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|busy" $OUT/moe/log.txt | cut -c1-200 | head -6
