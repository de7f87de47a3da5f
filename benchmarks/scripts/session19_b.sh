#!/bin/bash
# Prepared in session 19 (NOT RUN: no device lent). MoE 4 layers, one run, priority order (the budget stops starting
# new variants): bf16 vs ours (gated, fp8_reuse, 16-row token groups as a zero-filled copy: the default, session 18's
# step) vs ours +padgather (the padded layout by one gather) vs ours +align1 (no token-group padding) vs ours +keepdg
# (fp8_keep) vs ours +keepdg+align1. Session 18 call D: 95.08 ms vs bf16 113.98 (1.199x); 1.25x needs 91.2.
# Predicted: the gather -0.3 to -0.9 ms (a zero fill and a scatter forward, a gather backward, per MoE layer);
# align1 a little more than the gather (1 % fewer rows); fp8_keep -0.3 to -0.9 ms (6 recasts of 1.16 ms out, the
# forward weight cast +1 byte a parameter).
# Run session19_a.sh first: its GPU tests check both options' numbers.
#   bash benchmarks/scripts/session19_b.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
timeout 590 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+padgather,ours:tensorwise+head+tadam+align1,ours:tensorwise+head+tadam+keepdg,ours:tensorwise+head+tadam+keepdg+align1 \
  --steps 12 --warmup 3 --budget-s 520 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-220 | head -16
