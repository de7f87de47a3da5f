#!/bin/bash
# Session 9, device call C (one H200): (1) the dense linear layer at the ANCHORS.md shapes with the kernels-lookup fix
# (session 8's call A ran session-7 code, where the first tensorwise layer in the process could fall out of the
# compiled graph: its wo/wqkv wall-time losses may have been that); (2) a kernel profile of the dense step, ours
# tensorwise and bf16, to see where the 186.65 ms of call A go against the 176 ms that 1.30x needs.
# Run from the repo root on the device: bash benchmarks/scripts/session9_c.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/linear $OUT/dense
timeout 290 python3 benchmarks/fp8_linear.py --out $OUT/linear --budget-s 220 --prewarm 12 --skip-numerics \
  --impls bf16 torchao ours_compiled \
  --shapes llama3_8b.wo llama3_8b.wqkv llama3_8b.w13 llama3_8b.w2 llama3_70b.w13 > $OUT/linear/log.txt 2>&1
grep -A30 "^shape " $OUT/linear/log.txt | head -24
timeout 220 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --only ours:tensorwise,bf16 \
  --steps 6 --warmup 3 --profile --budget-s 150 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|busy" $OUT/dense/log.txt | cut -c1-200 | head -8
