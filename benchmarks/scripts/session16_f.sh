#!/bin/bash
# Session 16, device call F (one H200, the last ~200 s of the budget): fp8.grouped dgrad="fp8_reuse" (the grad-input
# GEMM on the forward's quantized expert weights, their row scales folded into the gradient's row cast).
# (1) its GPU accuracy test (tests/test_fp8_gpu.py, the fast-accumulation grad-input cases, which now include it);
# (2) moe_grouped.py: DeepSeek-MoE-16B routed experts, ours (hp wgrad) with dgrad fp8_reuse vs auto, and bf16.
#   bash benchmarks/scripts/session16_f.sh   ($OUT set by the device tool)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/grouped
timeout 45 python3 -m pytest -q --tb=short -k "fast_accum" tests/test_fp8_gpu.py -p no:cacheprovider 2>&1 | tail -4
timeout 85 python3 benchmarks/moe_grouped.py --out $OUT/grouped --skip-numerics --budget-s 60 \
  --cases ours_hp_r_compiled ours_hp_compiled bf16_compiled 2>&1 | grep -E "^\{|Error" | cut -c1-250
