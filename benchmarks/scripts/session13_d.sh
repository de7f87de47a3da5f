#!/bin/bash
# Session 13, device call D (one H200): every GPU test (tests/test_fp8_gpu.py) after this session's changes - the
# grouped GEMM's grad-input default is now fp8 with fast accumulation (dgrad="auto"), which every MoE test below runs.
#   bash benchmarks/scripts/session13_d.sh   ($OUT set by the device tool)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/tests
timeout 470 python3 -m pytest -q -rA tests/test_fp8_gpu.py -p no:cacheprovider --durations=8 2>&1 \
  | grep -v "Warning\|warnings.warn\|^  " | tail -45 | tee $OUT/tests/pytest_gpu.txt
