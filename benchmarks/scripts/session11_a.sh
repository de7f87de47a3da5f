#!/bin/bash
# Prepared in session 11 (no device time was left that session); run in the next session with device time.
# Device call A (one H200): (1) the GPU tests never run on the GPU yet (the FP8 output head, eager and compiled,
# now bounded above so a head silently in bf16 fails), then the whole GPU file; (2) the MoE step after session 10's
# worker changes (one gradient-norm pass, the clip after the guard's host read, the router-bias update now timed
# as the worker runs it): host profile of ours rowwise vs bf16, to measure the predicted <= ~1 ms less idle a step.
# Run from the repo root on the device: bash benchmarks/scripts/session11_a.sh  ($OUT set by the device tool)
# Wheels (torchao, and whatever KINDS.md says the image lacks) are optional here: no torchao row in this call.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/moe
timeout 200 python3 -m pytest -q -x tests/test_fp8_gpu.py -k output_head -p no:cacheprovider 2>&1 | tail -5 \
  > $OUT/tests/head.txt
cat $OUT/tests/head.txt
timeout 320 python3 benchmarks/train_step.py --out $OUT/moe --configs moe --only bf16,ours:rowwise,ours:tensorwise+head \
  --steps 8 --warmup 3 --host-profile --budget-s 260 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|idle|vs bf16|^moe" $OUT/moe/log.txt | cut -c1-200 | head -20
