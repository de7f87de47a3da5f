#!/bin/bash
# Session 16, device call A (one H200): (1) tests/test_adamw.py on the GPU (the unaligned-gradient case never ran on
# a GPU); (2) train_step.py MoE, 4 layers, bf16+tadam and ours tensorwise + FP8 head + tadam with a kernel profile of
# one step each (where the FP8 step's remaining time goes, with our AdamW on both sides).
#   bash benchmarks/scripts/session16_a.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/moe
timeout 100 python3 -m pytest -q --tb=short tests/test_adamw.py -p no:cacheprovider 2>&1 | tail -15 \
  | tee $OUT/tests/pytest_gpu.txt
timeout 330 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam --steps 8 --warmup 3 --budget-s 280 --profile --profile-top 70 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-200 | head -14
