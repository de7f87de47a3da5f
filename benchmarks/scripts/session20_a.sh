#!/bin/bash
# Session 20, first call: session19_a.sh (never run: session 19 had no device) with the fp8 transpose sweep added.
# (1) GPU tests: fp8_keep's both-layouts weight cast, its gradients vs fp8_reuse's, the group-scaled row cast after
#     session 18's last refactor, unaligned token groups (moe_token_group_align=1) vs padded.
# (2) reuse_kernels.py --sections both,recast,transpose: fp8_keep's kernel over tiles vs row cast + recast; the fp8
#     transpose over tiles at the MoE step's shapes (87 calls, 2.52 ms of session 18's profile).
# (3) moe_grouped.py: routed experts (fwd+bwd, 98304 rows) bf16 vs ours fp8_reuse vs ours fp8_keep, one run.
#   bash benchmarks/scripts/session20_a.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/reuse $OUT/grouped
timeout 200 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "rows_and_transposed or fast_accum_grad_input or group_scaled_row_cast or unaligned_token_groups" > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
timeout 150 python3 benchmarks/reuse_kernels.py --out $OUT/reuse --sections both,recast,transpose 2>&1 \
  | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
timeout 200 python3 benchmarks/moe_grouped.py --out $OUT/grouped --skip-numerics --budget-s 170 \
  --cases ours_hp_r_compiled ours_hp_k_compiled bf16_compiled 2>&1 | grep -E "^\{|Error" | cut -c1-250
