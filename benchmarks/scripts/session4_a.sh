#!/bin/bash
# Session 4, device call A (one H200): GPU tests, the compiled-MoE gradient bisect, the MoE training step.
# (Flags as of session 4; since then "+hpdg" is the default (use "+fp8dg" for all-fp8 dgrad) and "+tk" is the default.)
# Run from the repo root on the device: bash benchmarks/scripts/session4_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/a
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/a/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/a/gpu.txt
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8_gpu.py 2>&1 | tail -25 | tee $OUT/a/pytest_gpu.txt
timeout 140 python3 benchmarks/moe_grads_check.py --layers 2 \
  --cases opaque:inductor,traced:aot_eager,traced:inductor 2>&1 | grep -v Warning | tail -40 | tee $OUT/a/grads_check.txt
timeout 300 python3 benchmarks/train_step.py --out $OUT/a --configs moe --only bf16,ours:rowwise,ours:rowwise+hpdg,torchao:moe \
  --steps 5 --warmup 2 --profile --budget-s 235 2>&1 | grep -v "optimizer probe" | tail -60
