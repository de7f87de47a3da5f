#!/bin/bash
# Session 8, device call C (one H200): (1) the fix for CUDA graphs with the grouped ops (eager bodies under
# reduce-overhead, marked steps): new GPU test, then the MoE +cg row; (2) why the default dense tensorwise row swings
# (189 ms for 3 steps, then 228-235 ms, in call B's re-run; +minw1000 steady at 188): 12 steps with a kernel profile
# and a host profile, GPU clocks / power sampled every 200 ms alongside; (3) host vs GPU time of the compiled linear
# at wo and wk (benchmarks/linear_host.py: fp8_linear.py found ours host-bound there).
# Run from the repo root on the device: bash benchmarks/scripts/session8_c.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/moe $OUT/dense
timeout 100 python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short tests/test_fp8_gpu.py -k "cuda_graphs" \
  > $OUT/tests/pytest_cg.txt 2>&1
grep -E "^E |passed|failed|error" $OUT/tests/pytest_cg.txt | head -8
mkdir -p $OUT/host
timeout 110 python3 benchmarks/linear_host.py --out $OUT/host 2>&1 | grep -v "Warning\|warn\|^    " > $OUT/host/log.txt
grep -E "host|ERROR" $OUT/host/log.txt | head -20
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv \
  -lms 200 > $OUT/dense/smi.csv 2>&1 &
SMI=$!
timeout 160 python3 benchmarks/train_step.py --out $OUT/dense --configs dense --only ours:tensorwise \
  --steps 12 --warmup 3 --profile --host-profile 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
kill $SMI
grep -E "tok/s|ERROR|Error|busy" $OUT/dense/log.txt | cut -c1-200 | head -8
timeout 150 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --only ours:rowwise+cg,bf16+cg \
  --steps 12 --warmup 3 --budget-s 100 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error" $OUT/moe/log.txt | cut -c1-200 | head -6
