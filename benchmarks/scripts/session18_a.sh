#!/bin/bash
# Prepared in session 17 (NOT RUN: its device budget was spent) as the next session's first device call:
# (1) loss parity with session 17's fused-head loss kernels (150 steps, 65536-token vocabulary): bf16 vs ours
#     tensorwise + fused FP8 head (session 16 measured -0.09% with the previous kernels);
# (2) benchmarks/reuse_kernels.py: the fp8_reuse kernels' tile sweeps and bf16 multipliers (never tuned);
# (3) train_step.py MoE 4 layers, bf16 vs ours (shipped defaults: fp8_reuse, fused head with the 8 x 1024 backward
#     tile), with a kernel profile of 60 rows each: what is left of the casts, kernel by kernel.
#   bash benchmarks/scripts/session18_a.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/loss $OUT/moe $OUT/reuse
timeout 120 python3 benchmarks/reuse_kernels.py --out $OUT/reuse 2>&1 | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
timeout 170 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-steps 150 --loss-vocab pairs \
  --loss-variants bf16,ours:tensorwise+head 2>&1 | grep -E "^\[loss\]|^loss|Error" | head -8
timeout 260 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam --steps 12 --warmup 3 --profile --profile-top 60 \
  --budget-s 220 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|GPU busy" $OUT/moe/log.txt | cut -c1-200 | head -10
