#!/bin/bash
# Session 15, device call E (one H200): optim.ChunkedAdamW.
# (1) tests/test_adamw.py on the GPU; (2) benchmarks/adamw.py: the alignment hint on the pointers vs on the integers
# (call D's PTX had no vector loads), tiles 1024 and 512 elements x 4 and 2 warps; (3) train_step.py MoE, 4 layers:
# bf16 and ours tensorwise + FP8 head, each with torch's AdamW and with "+tadam".
#   bash benchmarks/scripts/session15_e.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/adamw $OUT/moe
timeout 90 python3 -m pytest -q --tb=line tests/test_adamw.py -p no:cacheprovider 2>&1 | tail -6 \
  | tee $OUT/tests/pytest_gpu.txt
timeout 120 python3 benchmarks/adamw.py --out $OUT/adamw --blocks 1024 512 --warps 4 2 2>&1 \
  | grep -v "Warning\|warn" | cut -c1-1500
timeout 320 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16,bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head --steps 8 --warmup 3 --budget-s 270 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-200 | head -14
