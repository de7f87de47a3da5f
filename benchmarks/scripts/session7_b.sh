#!/bin/bash
# Session 7, device call B (one H200): the end-to-end steps with narrow linears kept in bf16
# (precision.fp8_min_gemm_width; "+minw<W>" rows): MoE with W = 1100 (DeepSeek-MoE's 2048x2048 attention projections,
# width 1024, stay bf16) and W = 1800 (every dense linear of it stays bf16: only the routed experts in fp8, as
# torchao's MoE recipe), next to bf16, the default and torchao; dense Llama3-8B with W = 1000 (wk/wv 4096->1024, width
# 819, stay bf16) next to bf16, the default tensorwise and torchao tensorwise.
# Run from the repo root on the device: bash benchmarks/scripts/session7_b.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/dense
timeout 280 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16,ours:rowwise,ours:rowwise+minw1100,ours:rowwise+minw1800,torchao:moe \
  --steps 12 --warmup 2 --profile --budget-s 240 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|busy|ERROR" $OUT/moe/log.txt | cut -c1-200 | head -14
timeout 290 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16,ours:tensorwise,ours:tensorwise+minw1000,torchao:tensorwise \
  --steps 10 --warmup 2 --budget-s 250 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR" $OUT/dense/log.txt | cut -c1-200 | head -12
