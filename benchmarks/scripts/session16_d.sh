#!/bin/bash
# Session 16, device call D (one H200): the fused head's loss kernels, second sweep. (1) the GPU cases of
# tests/test_fp8_head.py; (2) benchmarks/ce_head.py: the forward kernel with several rows per program, the backward
# with smaller tiles, against
# Inductor's cross-entropy and the unfused gradient chain; (3) train_step.py MoE 4 layers and dense 8 layers
# with the fastest tiles of (2): bf16, ours tensorwise + FP8 head fused and unfused, our AdamW on all rows.
#   bash benchmarks/scripts/session16_d.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/ce $OUT/moe $OUT/dense
timeout 90 python3 -m pytest -q --tb=short -k gpu tests/test_fp8_head.py -p no:cacheprovider 2>&1 | tail -4
timeout 150 python3 benchmarks/ce_head.py --out $OUT/ce 2>&1 | grep -v "Warning\|warn"
timeout 170 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --ce-config $OUT/ce/ce_head.json \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nofce --steps 10 --warmup 3 --budget-s 130 \
  2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|fused-head" $OUT/moe/log.txt | cut -c1-200 | head -8
timeout 200 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --ce-config $OUT/ce/ce_head.json \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nofce --steps 8 --warmup 3 --budget-s 160 \
  2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -8
