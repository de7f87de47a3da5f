#!/bin/bash
# Session 7, device call D (one H200): the grouped GEMM custom ops' bodies compiled (fp8.grouped FP8_GROUPED_BODY,
# now the default on CUDA) after call C measured 450-530 us of host time per Triton launch from Python:
# GPU tests (compiled body == eager body; expert gradients follow bf16; no graph breaks; health kernel), the op's
# host time compiled vs eager (grouped_host.py), the MoE step compiled vs eager bodies next to bf16 and torchao, and the
# dense rows again (call C's default tensorwise row swung 212-269 ms per step).
# Run from the repo root on the device: bash benchmarks/scripts/session7_d.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/dense $OUT/host
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_gpu.py \
  -k "compiled_body or expert_grads or graph_breaks or routing or health" 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" > $OUT/host/pytest_gpu.txt; grep -E "^E |passed|failed|Error" $OUT/host/pytest_gpu.txt | head -12
timeout 60 python3 benchmarks/grouped_host.py --out $OUT/host --repeats 5 2>&1 | grep -v "Warning\|warn" \
  | tee $OUT/host/log.txt | tail -17
timeout 250 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16,ours:rowwise,ours:rowwise+eagerbody,torchao:moe \
  --steps 12 --warmup 2 --budget-s 200 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR" $OUT/moe/log.txt | cut -c1-200 | head -8
timeout 100 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --only bf16,ours:tensorwise \
  --steps 10 --warmup 2 --budget-s 60 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR" $OUT/dense/log.txt | cut -c1-200 | head -6
