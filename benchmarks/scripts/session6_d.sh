#!/bin/bash
# Session 6, device call D (one H200): the GPU test file after fp8.quant's kernel lookup changed (run inline).
export PYTHONUNBUFFERED=1; mkdir -p $OUT/d
timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_gpu.py 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" > $OUT/d/pytest_gpu.txt
