#!/bin/bash
# Session 20, after call B (the MoE A/B): what little device time is left goes to correctness first.
# (1) GPU tests of the session-19 options: unaligned token groups (moe_token_group_align=1, -0.6 ms in call B) vs
#     padded, fp8_keep's both-layouts cast and gradients, the group-scaled row cast after ad45fe3.
# (2) the fp8 transpose over tiles at the MoE step's shapes (87 calls, 2.52 ms of session 18's profile).
#   bash benchmarks/scripts/session20_d.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/reuse
timeout 170 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "unaligned_token_groups or rows_and_transposed or fast_accum_grad_input or group_scaled_row_cast" > $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt
timeout 100 python3 benchmarks/reuse_kernels.py --out $OUT/reuse --sections transpose 2>&1 \
  | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
