#!/bin/bash
# Prepared in session 19 (NOT RUN: no device lent). After session19_b: kernel profile (60 rows) and host profile of
# bf16 and of ours with the options that session19_b found faster (edit VARIANT), to see where the step's GPU time
# and idle go now.
#   bash benchmarks/scripts/session19_d.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
VARIANT=${VARIANT:-ours:tensorwise+head+tadam+keepdg+align1}
mkdir -p $OUT/moe
timeout 420 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --only bf16+tadam,$VARIANT --steps 12 \
  --warmup 3 --profile --profile-top 60 --host-profile --budget-s 380 2>&1 | grep -v "optimizer probe\|Warning\|warn(" \
  > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|GPU busy|idle ms" $OUT/moe/log.txt | cut -c1-220 | head -16
