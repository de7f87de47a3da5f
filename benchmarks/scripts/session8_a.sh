#!/bin/bash
# Session 8, device call A (one H200): every GPU test with the final session-7 code (its review changes - detached
# inputs under no_grad for the compiled grouped-op bodies, eager bodies during CUDA-graph capture - were CPU-tested
# only), then the dense linear benchmark at the ANCHORS.md shapes with a kernel table per case (--profile), to find
# what ours spends beyond torchao where it lost (8B wo tensorwise 0.89x in session 2, never re-run since).
# Run from the repo root on the device: bash benchmarks/scripts/session8_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/linear
timeout 230 python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short tests/test_fp8_gpu.py > $OUT/tests/pytest_gpu.txt 2>&1
grep -E "^E |passed|failed|error" $OUT/tests/pytest_gpu.txt | head -12
timeout 300 python3 benchmarks/fp8_linear.py --out $OUT/linear --budget-s 200 --prewarm 12 --skip-numerics --profile \
  --impls bf16 torchao ours_compiled \
  --shapes llama3_8b.wo llama3_8b.wqkv llama3_8b.w13 llama3_8b.w2 llama3_70b.w13 > $OUT/linear/log.txt 2>&1
grep -A30 "^shape " $OUT/linear/log.txt | head -24
