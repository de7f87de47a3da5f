#!/bin/bash
# Session 16, device call B (one H200): the FP8 output head with the loss fused into it (fp8/head.py).
# (1) tests/test_fp8_head.py on the GPU; (2) train_step.py MoE 4 layers and dense 8 layers, one run each: bf16 and
# ours tensorwise + FP8 head, fused (default) and unfused ("+nofce"), all with our AdamW; a profile of the MoE rows;
# (3) loss parity with a 65536-token vocabulary, 150 steps: bf16 vs ours tensorwise + fused FP8 head.
#   bash benchmarks/scripts/session16_b.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/moe $OUT/dense $OUT/loss
timeout 120 python3 -m pytest -q --tb=short tests/test_fp8_head.py -p no:cacheprovider 2>&1 | tail -15 \
  | tee $OUT/tests/pytest_gpu.txt
timeout 200 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nofce --steps 8 --warmup 3 --budget-s 150 \
  --profile --profile-top 40 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-200 | head -8
timeout 240 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nofce --steps 8 --warmup 3 --budget-s 200 \
  2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -8
timeout 150 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-steps 150 --loss-vocab pairs \
  --loss-variants bf16,ours:tensorwise+head 2>&1 | grep -E "^\[loss\]|^loss|Error" | head -8
