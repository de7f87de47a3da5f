#!/bin/bash
# Session 10, device call D (one H200): the FP8 output head on the MoE step. DeepSeek-MoE-16B's head (vocab 102400,
# 16384 tokens per step) is ~26 ms of bf16 GEMM in call A's profile, a fifth of the 124 ms step.
# Run from the repo root on the device: bash benchmarks/scripts/session10_d.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
timeout 380 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16,ours:rowwise+head,ours:rowwise,ours:tensorwise+head --steps 8 --warmup 3 --budget-s 300 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|memory" $OUT/moe/log.txt | cut -c1-200 | head -8
