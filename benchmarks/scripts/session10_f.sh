#!/bin/bash
# Session 10, device call F (one H200): Inductor's coordinate-descent tuning ("+cdt") on the dense 8-layer step.
# Call A's profile: the FP8 step's fused elementwise/reduction kernels (casts with the SwiGLU and norm producers)
# take 23 ms vs 12 ms in bf16, and the tensorwise amax reductions run at 2.5-3.1 TB/s; better block sizes would
# help the FP8 side more. The cdt rows run first (a time budget stops the rest).
# Run from the repo root on the device: bash benchmarks/scripts/session10_f.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/dense
timeout 245 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only ours:tensorwise+cdt,bf16+cdt,ours:tensorwise,bf16 --steps 6 --warmup 2 --budget-s 185 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|memory" $OUT/dense/log.txt | cut -c1-200 | head -8
