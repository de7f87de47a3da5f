#!/bin/bash
# Session 18, call C: (1) where the FP8 MoE step still synchronises the host (call B's host profile: one
# cudaStreamSynchronize a step besides the guard's event wait, and the GPU idle at the next step's start): the
# synchronising calls of one step with their Python stacks (--sync-probe); (2) loss parity 150 steps with the drift
# yardstick: bf16, bf16 from another init (+seed1), ours fused head, ours unfused head (+nofce): calls A and B put
# the fused head at +0.92% / +1.63% (session 16: -0.09%).
#   bash benchmarks/scripts/session18_c.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/loss
timeout 200 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --only ours:tensorwise+head+tadam \
  --steps 3 --warmup 2 --sync-probe 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/moe/log.txt
grep -E "sync x|tok/s|Error" $OUT/moe/log.txt | cut -c1-400
timeout 240 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-steps 150 --loss-vocab pairs \
  --loss-variants bf16,bf16+seed1,ours:tensorwise+head,ours:tensorwise+head+nofce 2>&1 | grep -E "^\[loss\]|^loss|Error" | head -10
