#!/bin/bash
# Session 6, device call A (one H200): where the FP8 MoE step's host time goes (its GPU idle was 9-25 ms vs ~3 ms
# for bf16): host time by step phase, GPU idle attributed to phases, GC pauses with Python's automatic GC
# ("+autogc", every earlier row) vs the worker's scheduled GC (now the default); then the full GPU test file with
# the session-5 defaults (not all of it had run since they changed).
# Run from the repo root on the device: bash benchmarks/scripts/session6_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/a
timeout 330 python3 benchmarks/train_step.py --out $OUT/a --configs moe \
  --only bf16,ours:rowwise,ours:rowwise+autogc,torchao:moe \
  --steps 8 --warmup 2 --profile --host-profile --budget-s 270 2>&1 | grep -v "optimizer probe" > $OUT/a/moe_log.txt
tail -12 $OUT/a/moe_log.txt
timeout 245 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_gpu.py 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" > $OUT/a/pytest_gpu.txt; grep -E "^E |passed|failed|Error" $OUT/a/pytest_gpu.txt | head -30
