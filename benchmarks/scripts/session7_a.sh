#!/bin/bash
# Session 7, device call A (one H200): the FP8 grouped GEMM op bodies' host time, piece by piece
# (benchmarks/grouped_host.py: whole op, each cast, the GEMM, health statistics by the torch reference vs the new
# one-launch kernel), the GPU checks of that kernel against the reference, and the MoE training step with the
# kernel (default) vs the reference ("+refhealth") next to bf16 and torchao, with a host profile per row.
# Run from the repo root on the device: bash benchmarks/scripts/session7_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/a
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_gpu.py -k health 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" > $OUT/a/pytest_gpu_health.txt; grep -E "^E |passed|failed|Error" $OUT/a/pytest_gpu_health.txt | head
timeout 150 python3 benchmarks/grouped_host.py --out $OUT/a 2>&1 | grep -v "Warning\|warn" | tee $OUT/a/grouped_host_log.txt | tail -16
timeout 330 python3 benchmarks/train_step.py --out $OUT/a --configs moe \
  --only bf16,ours:rowwise,ours:rowwise+refhealth,torchao:moe \
  --steps 12 --warmup 2 --host-profile --budget-s 300 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/a/moe_log.txt
grep -E "ms/step|tok/s|idle|elastic_fp8" $OUT/a/moe_log.txt | cut -c1-300 | head -40
