#!/bin/bash
# Session 20, after call D found fp8_keep's both-layouts kernel wrong on the H200 at DeepSeek-MoE's shapes (parts of
# the transposed output unwritten): the kernel now writes the transposed layout in its own pass, tile by tile as the
# GPU-tested recast kernel does. GPU tests of fp8_keep again; its kernel's tiles vs fp8_reuse's row cast + recast.
#   bash benchmarks/scripts/session20_e.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/reuse
timeout 150 python3 -m pytest -q --tb=line -W ignore -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "rows_and_transposed or fast_accum_grad_input" > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt
timeout 120 python3 benchmarks/reuse_kernels.py --out $OUT/reuse --sections both 2>&1 \
  | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
