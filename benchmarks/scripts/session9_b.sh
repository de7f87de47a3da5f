#!/bin/bash
# Session 9, device call B (one H200): the GPU tests call A's 250 s timeout cut off (19 of 22 ran and passed: the
# compiled grouped body, CUDA graphs marked/unmarked, the tensorwise linear as one graph), then the MoE rows with the
# kernels-lookup fix: ours rowwise, bf16, torchao's MoE recipe.
# Run from the repo root on the device: bash benchmarks/scripts/session9_b.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/moe
timeout 250 python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short tests/test_fp8_gpu.py \
  -k "compiled_body_matches or cuda_graphs_matches or one_graph_in_a_fresh" > $OUT/tests/pytest_gpu.txt 2>&1
grep -E "^E |^FAILED|passed|failed|error" $OUT/tests/pytest_gpu.txt | cut -c1-220 | head -16
timeout 300 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only ours:rowwise,bf16,torchao:moe --steps 12 --warmup 3 --budget-s 230 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error" $OUT/moe/log.txt | cut -c1-200 | head -8
