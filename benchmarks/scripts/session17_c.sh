#!/bin/bash
# Session 17, device call C: the fused head's loss kernels with the accuracy fix (exp of the difference, not a
# multiply-add: call B's GPU test found a well-predicted target's p - 1 up to 37 fp8 steps off) and the sweep's tiles
# as defaults; train_step.py timing steps back to back (no host wait between steps); torchao rows in the same run.
# (1) the fused head's GPU tests; (2) ce_head.py (kernels alone); (3) train_step.py MoE 4 layers and dense 8 layers:
# bf16, ours tensorwise + fused FP8 head, torchao (our AdamW on all), MoE with a host profile.
#   bash benchmarks/scripts/session17_c.sh   ($OUT set by the device tool; carry .whl for torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/ce $OUT/moe $OUT/dense $OUT/tests
timeout 90 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider -k test_gpu tests/test_fp8_head.py \
  > $OUT/tests/head_gpu.txt 2>&1; tail -2 $OUT/tests/head_gpu.txt
timeout 150 python3 benchmarks/ce_head.py --out $OUT/ce 2>&1 | grep -v "Warning\|warn" > $OUT/ce/log.txt
grep -E "copy|forward tile=\(1, 1024\) warps=2|fused_t=False tile=\(16, 512\)|best" $OUT/ce/log.txt | cut -c1-120
timeout 240 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,torchao:moe+tadam --steps 12 --warmup 3 --host-profile \
  --budget-s 200 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|GPU idle ms" $OUT/moe/log.txt | cut -c1-220 | head -12
timeout 200 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16+tadam,ours:tensorwise+head+tadam,torchao:tensorwise+head+tadam --steps 8 --warmup 3 --budget-s 160 \
  2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -8
