#!/bin/bash
# Session 8, call C2 (call C's warm machine, its caches filled): the dense tensorwise step with Inductor writing the fp8
# transposes (+ntk) next to the default, after call C's host profile showed the default host-bound.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; mkdir -p $OUT/d
timeout 140 python3 benchmarks/train_step.py --out $OUT/d --configs dense --only ours:tensorwise+ntk,ours:tensorwise \
  --steps 8 --warmup 3 --budget-s 90 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/d/log.txt
grep -E "tok/s|ERROR" $OUT/d/log.txt | cut -c1-200
