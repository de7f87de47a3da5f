#!/bin/bash
# Session 16, device call C (one H200): the fused head's loss kernels. (1) the interpreter cases of
# tests/test_fp8_head.py on this machine's triton (they failed here in call B; the full error); (2)
# benchmarks/ce_head.py: the forward kernel with per-lane state and the backward with int8 stores and other tiles,
# against Inductor's cross-entropy and the unfused gradient chain; (3) train_step.py MoE 4 layers and dense 8 layers
# with the fastest tiles of (2): bf16, ours tensorwise + FP8 head fused and unfused, our AdamW on all rows.
#   bash benchmarks/scripts/session16_c.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/ce $OUT/moe $OUT/dense
TRITON_INTERPRET=1 ELASTIC_FP8_INTERP_CHILD=1 timeout 60 python3 -m pytest -q -x --tb=long -k interp \
  tests/test_fp8_head.py -p no:cacheprovider > $OUT/tests/interp.txt 2>&1
grep -E "^E|passed|failed|error" $OUT/tests/interp.txt | head -30
timeout 150 python3 benchmarks/ce_head.py --out $OUT/ce 2>&1 | grep -v "Warning\|warn"
timeout 170 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --ce-config $OUT/ce/ce_head.json \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nofce --steps 10 --warmup 3 --budget-s 130 \
  2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|fused-head" $OUT/moe/log.txt | cut -c1-200 | head -8
timeout 200 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --ce-config $OUT/ce/ce_head.json \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nofce --steps 8 --warmup 3 --budget-s 160 \
  2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -8
