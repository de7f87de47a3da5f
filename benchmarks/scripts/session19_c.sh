#!/bin/bash
# Prepared in sessions 18-19 (NOT RUN: no device lent). (1) loss parity over 300 steps (150-step runs of the same
# code gave +0.92 / +1.63 / +0.01 % vs bf16); (2) the plain row cast's tiles (incl. one row a program looped over
# 1024/2048 columns) and the group-scaled row cast at 98304 x {2816, 2048, 1408}; (3) the fp8 transpose over tiles at
# the MoE step's shapes (87 calls, 2.52 ms of session 18's profile).
#   bash benchmarks/scripts/session19_c.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/loss $OUT/reuse
timeout 300 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-steps 300 --loss-vocab pairs \
  --loss-variants bf16,ours:tensorwise+head 2>&1 | grep -E "^\[loss\]|^loss|Error" | head -8
timeout 240 python3 benchmarks/reuse_kernels.py --out $OUT/reuse --sections rowcast,group,transpose 2>&1 \
  | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
