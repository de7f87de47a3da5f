#!/bin/bash
# Prepared in session 19 (NOT RUN: no device lent). MoE 4 layers, one run: bf16 vs ours (gated, fp8_reuse: the
# default) vs ours +keepdg (fp8_keep), with a kernel profile (60 rows) and a host profile: where the gated step's GPU
# time and idle go now (session 18 call D: 95.08 ms vs bf16 113.98; 1.25x needs 91.2).
#   bash benchmarks/scripts/session19_b.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
timeout 420 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+keepdg --steps 12 --warmup 3 \
  --profile --profile-top 60 --host-profile --budget-s 380 2>&1 | grep -v "optimizer probe\|Warning\|warn(" \
  > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|GPU busy|idle ms" $OUT/moe/log.txt | cut -c1-220 | head -16
