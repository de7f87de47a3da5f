#!/bin/bash
# Session 21 (no device lent; prepared for the next one), first call: the GPU re-check of fp8_keep's fixed both-layouts
# kernel (session 20 call D found its transposed output partly unwritten on the H200; session20_e.sh never ran), then
# the kernel sweeps now timed by CUDA-graph replay (benchmarks.common.bandwidth_row: session 20's launched sweep sat on
# a 0.15 ms host floor): fp8_keep's kernel vs fp8_reuse's row cast + recast, and the fp8 transpose tiles at the MoE
# step's shapes (87 transposes, 2.52 ms of session 18's profile: ~29 us a call). Also the GPU test of
# precision.fp8_tensorwise_transposes=forward (bit-equal to the default, no transpose kernel left).
#   bash benchmarks/scripts/session21_a.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/reuse
timeout 150 python3 -m pytest -q --tb=line -W ignore -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "rows_and_transposed or fast_accum_grad_input or tensorwise_transposes_in_forward" > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt
timeout 240 python3 benchmarks/reuse_kernels.py --out $OUT/reuse --sections both,transpose 2>&1 \
  | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
