#!/bin/bash
# Session 21 (prepared for the next device session), second call: MoE 4 layers, one run, in priority order.
# bf16; ours (default: 97.56 ms vs bf16 117.95 in session 20, 1.209x; 1.25x needs ~94.4); +tfwd (the tensorwise fp8
# transposes written by the casts' kernels: predicted -1 to -2 ms, if Inductor's two-layout stores coalesce; only if
# session21_a's GPU test of it passed); ours with the routed experts
# in bf16 (+noexp: session 18's profile put their FP8 GEMM saving, ~1.5 ms a layer, level with their casts, ~1.6 ms,
# moe_grouped.py a ~0.9 ms gain a layer; predicted 0 to +3 ms slower than ours; if it is not slower, fp8_experts
# should default off at this width); +align1 (session 20:
# -0.6 ms, within noise); +keepdg+align1 (fp8_keep, only if session21_a's GPU tests passed: its kernel was wrong
# before); then bf16 and ours again (the run's drift).
#   bash benchmarks/scripts/session21_b.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
T=ours:tensorwise+head+tadam
timeout 590 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,$T,$T+tfwd,$T+noexp,$T+align1,$T+tfwd+align1,$T+keepdg+align1,bf16+tadam,$T \
  --steps 12 --warmup 3 --budget-s 530 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-220 | head -20
