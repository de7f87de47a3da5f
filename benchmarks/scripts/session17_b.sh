#!/bin/bash
# Session 17, device call B: the fused head's loss kernels rewritten (forward: two reductions a tile, the masked
# non-target max only in the tile holding the target, the target's logit one load, exp2 with the scaling in one
# multiply-add, unmasked full tiles; backward: unmasked full tiles, the transposed copy stored by the kernel or by a
# separate transpose pass) and dgrad="fp8_reuse" as fp8.grouped's default:
# (1) the fused head's GPU tests (kernels vs references, both transposed-copy paths);
# (2) benchmarks/ce_head.py tile sweep (16384 x 102400);
# (3) train_step.py MoE 4 layers with the sweep's fastest tiles: bf16 and ours tensorwise + fused FP8 head (our
#     AdamW on both), with a kernel profile of one step each.
#   bash benchmarks/scripts/session17_b.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/ce $OUT/moe $OUT/tests
timeout 90 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider -k test_gpu tests/test_fp8_head.py \
  > $OUT/tests/head_gpu.txt 2>&1; tail -2 $OUT/tests/head_gpu.txt
timeout 150 python3 benchmarks/ce_head.py --out $OUT/ce 2>&1 | grep -v "Warning\|warn" > $OUT/ce/log.txt
cut -c1-110 $OUT/ce/log.txt
timeout 260 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --ce-config $OUT/ce/ce_head.json \
  --only bf16+tadam,ours:tensorwise+head+tadam --steps 10 --warmup 3 --profile \
  --budget-s 220 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|loss kernels|GPU busy" $OUT/moe/log.txt | cut -c1-200 | head -12
