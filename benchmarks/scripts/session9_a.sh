#!/bin/bash
# Session 9, device call A (one H200): every GPU test with session 8's fixes (22 tests; three never ran: CUDA graphs
# with marked and unmarked steps, the tensorwise Float8Linear as one graph in a fresh process), then the dense rows
# with the kernels-lookup graph-break fix: ours tensorwise first, bf16, torchao tensorwise, ours rowwise, torchao rowwise.
# Run from the repo root on the device: bash benchmarks/scripts/session9_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/dense
timeout 250 python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short tests/test_fp8_gpu.py > $OUT/tests/pytest_gpu.txt 2>&1
grep -E "^E |^FAILED|passed|failed|error" $OUT/tests/pytest_gpu.txt | cut -c1-220 | head -16
timeout 330 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only ours:tensorwise,bf16,torchao:tensorwise,ours:rowwise,torchao:rowwise --steps 8 --warmup 3 --budget-s 250 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error" $OUT/dense/log.txt | cut -c1-200 | head -10
