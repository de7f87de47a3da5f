#!/bin/bash
# Prepared in session 18 (NOT RUN: its device budget was spent) as the next session's first device call:
# (1) MoE 4 layers, bf16 vs ours with the gated optimizer step: kernel profile (60 rows) and host profile - what
#     idle is left in ours' step (call D: 95.08 ms timed vs ~92.7 ms of GPU work in call A's profile) and which casts;
# (2) benchmarks/reuse_kernels.py, timed back to back: the plain row cast's tiles (incl. one row a program looped
#     over 1024/2048 columns) and the group-scaled row cast at 98304 x {2816, 2048, 1408};
# (3) loss parity over 300 steps (150-step runs of the same code gave +0.92 / +1.63 / +0.01 %).
#   bash benchmarks/scripts/session19_a.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/loss $OUT/reuse
timeout 280 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam --steps 12 --warmup 3 --profile --profile-top 60 --host-profile \
  --budget-s 240 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|GPU busy|idle ms" $OUT/moe/log.txt | cut -c1-220 | head -12
timeout 120 python3 benchmarks/reuse_kernels.py --out $OUT/reuse 2>&1 | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
timeout 180 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-steps 300 --loss-vocab pairs \
  --loss-variants bf16,ours:tensorwise+head 2>&1 | grep -E "^\[loss\]|^loss|Error" | head -8
