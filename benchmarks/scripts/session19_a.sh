#!/bin/bash
# Prepared in sessions 18-19 (NOT RUN yet: session 19 was lent no device) as the next device session's first call.
# (1) GPU tests: the new both-layouts weight cast (fp8_keep) vs its reference and vs row cast + recast; fp8_keep's
#     gradients equal fp8_reuse's bit for bit in the grad-input accuracy case; the group-scaled row cast after
#     session 18's last refactor (ad45fe3, interpreter-tested only).
# (2) benchmarks/reuse_kernels.py --sections both,recast: fp8_keep's kernel over tiles vs fp8_reuse's row cast +
#     recast, at DeepSeek-MoE-16B's w13 [64, 2816, 2048] and w2 [64, 2048, 1408].
# (3) moe_grouped.py: the routed experts (fwd+bwd, 98304 rows) bf16 vs ours fp8_reuse vs ours fp8_keep, one run.
# Predicted: fp8_keep saves the recast's second read of the bf16 weight, ~2 of 6 bytes a parameter if the kernel's
# re-read of its rows hits L2: -0.2 to -0.3 ms a layer; nothing if it misses.
#   bash benchmarks/scripts/session19_a.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/reuse $OUT/grouped
timeout 200 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "rows_and_transposed or fast_accum_grad_input or group_scaled_row_cast or unaligned_token_groups" > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
timeout 150 python3 benchmarks/reuse_kernels.py --out $OUT/reuse --sections both,recast 2>&1 \
  | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
timeout 200 python3 benchmarks/moe_grouped.py --out $OUT/grouped --skip-numerics --budget-s 170 \
  --cases ours_hp_r_compiled ours_hp_k_compiled bf16_compiled 2>&1 | grep -E "^\{|Error" | cut -c1-250
