#!/bin/bash
# Session 16, device call F - NOT RUN (the session's device budget was spent; the next session's first call):
# fp8.grouped dgrad="fp8_reuse" (the grad-input GEMM on the forward's quantized expert weights, their row scales
# folded into the gradient's row cast), built on CPU after the budget ran out.
# (1) its GPU accuracy test (tests/test_fp8_gpu.py, the fast-accumulation grad-input cases, which now include it) and
#     the fused head's GPU tests (the device-side target check added after session 16's timings);
# (2) moe_grouped.py: DeepSeek-MoE-16B routed experts, ours (hp wgrad) with dgrad fp8_reuse vs auto, and bf16;
# (3) train_step.py MoE 4 layers: bf16, ours tensorwise + fused FP8 head, the same with "+reusedg" (our AdamW on all).
#   bash benchmarks/scripts/session16_f.sh   ($OUT set by the device tool; nothing to carry: no torchao rows)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/grouped $OUT/moe
timeout 60 python3 -m pytest -q --tb=short -k fast_accum tests/test_fp8_gpu.py -p no:cacheprovider 2>&1 | tail -3
timeout 60 python3 -m pytest -q --tb=short -k test_gpu tests/test_fp8_head.py -p no:cacheprovider 2>&1 | tail -3
timeout 150 python3 benchmarks/moe_grouped.py --out $OUT/grouped --skip-numerics --budget-s 110 \
  --cases ours_hp_r_compiled ours_hp_compiled bf16_compiled 2>&1 | grep -E "^\{|Error" | cut -c1-250
timeout 200 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+reusedg --steps 10 --warmup 3 \
  --budget-s 160 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-200 | head -8
