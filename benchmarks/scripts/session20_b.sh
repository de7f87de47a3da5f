#!/bin/bash
# Session 20, second call: MoE 4 layers, one run, in priority order (the budget stops starting new variants).
# bf16; ours (session 18's step: 95.08 vs 113.98 ms, 1.199x; 1.25x needs ~91.2 ms); ours with all three session-19
# options (+keepdg +align1 +padgather); then each alone; then CUDA graphs on both sides (+cg: session 18's profile
# had 3.98 ms of GPU idle in ours vs 1.72 in bf16, and the routing has static shapes and no host sync).
# Predicted: padgather -0.3..-0.9 ms, align1 a little more, keepdg -0.3..-0.9 ms; +cg -2 ms on ours, ~0 on bf16.
#   bash benchmarks/scripts/session20_b.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
T=ours:tensorwise+head+tadam
timeout 590 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,$T,$T+keepdg+align1+padgather,$T+keepdg,$T+padgather,$T+align1,$T+keepdg+align1+padgather+cg,bf16+tadam+cg \
  --steps 12 --warmup 3 --budget-s 530 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-220 | head -20
