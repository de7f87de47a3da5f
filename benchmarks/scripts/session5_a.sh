#!/bin/bash
# Session 5, device call A (one H200): the GPU tests not reached in session 4 (its 120 s cap) and the changed
# default cast path, then the MoE training step with the new defaults (dgrad "auto", fp8 transposes as kernels)
# against bf16 and torchao, plus CUDA-graph variants of bf16 and ours (the MoE step had ~9 ms of GPU idle).
# Run from the repo root on the device: bash benchmarks/scripts/session5_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/a
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee $OUT/a/gpu.txt
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8_gpu.py \
  -k "compiled_float8_linear or compiled-eager-grouped or model_routing or compiled-opaque" 2>&1 | tail -25 \
  | tee $OUT/a/pytest_gpu.txt
timeout 400 python3 benchmarks/train_step.py --out $OUT/a --configs moe \
  --only bf16,ours:rowwise,torchao:moe,ours:rowwise+fp8dg,ours:rowwise+cg,bf16+cg \
  --steps 5 --warmup 2 --profile --budget-s 330 2>&1 | grep -v "optimizer probe" | tail -70
