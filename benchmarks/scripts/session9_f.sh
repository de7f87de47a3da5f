#!/bin/bash
# Session 9, device call F (one H200): the dense rows at Llama3-8B's full depth (32 layers). Call D measured 50.2 GB
# at 16 layers against 30.7 GB at 8 (~2.4 GB a layer), so 32 layers fit one H200 (~90 GB): the full model, where the
# bf16 head, fixed per model, weighs least. Projected from calls C and D: ~1.28x bf16 for ours tensorwise.
# Run from the repo root on the device: bash benchmarks/scripts/session9_f.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/dense32
timeout 200 python3 benchmarks/train_step.py --out $OUT/dense32 --configs dense --dense-layers 32 \
  --only ours:tensorwise,bf16,torchao:tensorwise --steps 6 --warmup 3 --budget-s 120 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense32/log.txt
grep -E "tok/s|ERROR|Error|memory" $OUT/dense32/log.txt | cut -c1-200 | head -6
