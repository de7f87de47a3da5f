#!/bin/bash
# Session 7, one device call with the most important measurements first (device starts kept failing, so A and B
# were merged by priority into one 10-minute call):
# 1. MoE step: bf16, ours default, narrow linears in bf16 ("+minw1800": only the routed experts fp8, as torchao's
#    MoE recipe; "+minw1100": DeepSeek-MoE's 2048x2048 attention projections bf16), torchao, and the health
#    statistics by the torch reference ("+refhealth") instead of the new one-launch kernel;
# 2. the grouped GEMM op bodies' host time piece by piece (benchmarks/grouped_host.py);
# 3. the health kernel against the reference on the GPU;
# 4. dense step: bf16, ours tensorwise, ours with wk/wv (width 819) in bf16 ("+minw1000").
# Run from the repo root on the device: bash benchmarks/scripts/session7_c.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/dense $OUT/host
timeout 335 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16,ours:rowwise,ours:rowwise+minw1800,ours:rowwise+refhealth,torchao:moe,ours:rowwise+minw1100 \
  --steps 12 --warmup 2 --budget-s 285 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR" $OUT/moe/log.txt | cut -c1-200 | head -14
timeout 50 python3 benchmarks/grouped_host.py --out $OUT/host --repeats 5 2>&1 | grep -v "Warning\|warn" \
  | tee $OUT/host/log.txt | tail -16
timeout 40 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_gpu.py -k health 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" > $OUT/host/pytest_gpu_health.txt; grep -E "^E |passed|failed|Error" $OUT/host/pytest_gpu_health.txt | head -5
timeout 125 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16,ours:tensorwise,ours:tensorwise+minw1000 \
  --steps 10 --warmup 2 --budget-s 75 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR" $OUT/dense/log.txt | cut -c1-200 | head -8
