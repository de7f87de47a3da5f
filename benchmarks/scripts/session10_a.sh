#!/bin/bash
# Session 10, device call A (one H200): where the FP8-only time of the dense step goes, kernel by kernel (the 8-layer
# profile of session 9 listed only the top 15: fused elementwise +10.8 ms and transposes +3.9 ms over bf16), and the
# host side of the MoE step's ~10 ms of GPU idle, with and without CUDA graphs.
# Run from the repo root on the device: bash benchmarks/scripts/session10_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/dense $OUT/moe
timeout 240 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --only ours:tensorwise,bf16 \
  --steps 6 --warmup 3 --profile --profile-top 90 --budget-s 160 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|busy" $OUT/dense/log.txt | cut -c1-200 | head -8
timeout 300 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --only ours:rowwise,bf16,ours:rowwise+cg \
  --steps 6 --warmup 3 --host-profile --profile --profile-top 60 --budget-s 200 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|busy" $OUT/moe/log.txt | cut -c1-200 | head -8
