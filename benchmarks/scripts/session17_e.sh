#!/bin/bash
# Session 17, device call E: the GPU tests of tests/test_fp8_gpu.py that call A did not run, now with
# dgrad="fp8_reuse" as fp8.grouped's default (the MoE model tests, compiled vs eager, CUDA graphs, the FP8 head).
#   bash benchmarks/scripts/session17_e.sh   ($OUT set by the device tool; nothing to carry)
mkdir -p $OUT
timeout 450 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "not fast_accum and not compiled_ops_launch and not health_kernel" > $OUT/fp8_gpu.txt 2>&1
tail -15 $OUT/fp8_gpu.txt | cut -c1-250
