#!/bin/bash
# Session 15, device call D (one H200): optim.ChunkedAdamW after the unmasked whole-chunk path (call C: 2.1x torch's
# fused AdamW + clip for bf16, 1.5x for fp32, best tile 1024 elements / 4 warps, now the default).
# (1) tests/test_adamw.py on the GPU; (2) benchmarks/adamw.py, a finer tile sweep; (3) train_step.py dense, 8 layers:
# bf16 and ours tensorwise + FP8 head, each with torch's AdamW and with "+tadam".
#   bash benchmarks/scripts/session15_d.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/adamw $OUT/dense
timeout 90 python3 -m pytest -q --tb=short tests/test_adamw.py -p no:cacheprovider 2>&1 | grep -v "^  " | tail -25 \
  | tee $OUT/tests/pytest_gpu.txt
timeout 150 python3 benchmarks/adamw.py --out $OUT/adamw 2>&1 | grep -v "Warning\|warn" | cut -c1-1500
timeout 300 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16,bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head --steps 8 --warmup 3 --budget-s 250 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -14
