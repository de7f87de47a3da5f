#!/bin/bash
# Session 17, device call A (session16_f.sh plus the row-cast kernels' GPU checks):
# (1) GPU tests: the grouped fast-accumulation grad-input cases (now including dgrad="fp8_reuse"), the compiled
#     custom ops vs eager (the row cast kernel restructured in session 16 after its last GPU run), the health
#     kernel, and the fused head's GPU tests (device-side target check added after session 16's timings);
# (2) moe_grouped.py: DeepSeek-MoE-16B routed experts, ours (hp wgrad) with dgrad fp8_reuse vs auto, and bf16;
# (3) train_step.py MoE 4 layers: bf16, ours tensorwise + fused FP8 head, the same with "+reusedg" (our AdamW on all).
#   bash benchmarks/scripts/session17_a.sh   ($OUT set by the device tool; nothing to carry: no torchao rows)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/grouped $OUT/moe $OUT/tests
timeout 200 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "fast_accum or compiled_ops_launch or health_kernel" > $OUT/tests/fp8_gpu.txt 2>&1; tail -3 $OUT/tests/fp8_gpu.txt
timeout 60 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider -k test_gpu tests/test_fp8_head.py \
  > $OUT/tests/head_gpu.txt 2>&1; tail -2 $OUT/tests/head_gpu.txt
timeout 150 python3 benchmarks/moe_grouped.py --out $OUT/grouped --skip-numerics --budget-s 110 \
  --cases ours_hp_r_compiled ours_hp_compiled bf16_compiled 2>&1 | grep -E "^\{|Error" | cut -c1-250
timeout 200 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+reusedg --steps 10 --warmup 3 \
  --budget-s 160 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-200 | head -8
