#!/bin/bash
# Session 21 (prepared for the next device session), third call: the dense step (Llama3-8B width, 8 layers) with the
# tensorwise fp8 transposes written by the casts' kernels (+tfwd) against the default, bf16 first (session 18 call F:
# bf16 213.34 ms, ours 154.90, 1.377x). Dense steps transpose larger tensors (x 8192 x 4096/14336 per linear), so
# +tfwd should move more here than on the MoE step. Then the loss parity over 300 steps (session20_c.sh) if time is
# left: run it as a separate call.
#   bash benchmarks/scripts/session21_c.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1; mkdir -p $OUT/dense
T=ours:tensorwise+head+tadam
timeout 330 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --only bf16+tadam,$T,$T+tfwd \
  --steps 8 --warmup 3 --budget-s 260 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -8
