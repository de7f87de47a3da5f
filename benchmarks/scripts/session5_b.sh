#!/bin/bash
# Session 5, device call B (one H200): the GPU tests of call A again with their failure text (call A's tail cut
# it off), then the dense training step with the new default (tensorwise's fp8 transposed copies as our kernel
# under compile), every recipe against bf16 and torchao in one run.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/b
timeout 130 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_gpu.py \
  -k "compiled_float8_linear or compiled-eager-grouped or model_routing or compiled-opaque" 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" > $OUT/b/pytest_gpu.txt; grep -E "^E |passed|failed|Error" $OUT/b/pytest_gpu.txt | head -30
timeout 370 python3 benchmarks/train_step.py --out $OUT/b --configs dense \
  --only bf16,ours:tensorwise,torchao:tensorwise,ours:rowwise,torchao:rowwise \
  --steps 5 --warmup 2 --profile --budget-s 290 2>&1 | grep -v "optimizer probe" | tail -12
