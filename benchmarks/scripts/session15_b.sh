#!/bin/bash
# Session 15, device call B (one H200): optim.ChunkedAdamW (one Triton launch per step, clip folded in).
# (1) tests/test_adamw.py on the GPU (kernel vs torch's fused AdamW, fp32 and bf16);
# (2) benchmarks/adamw.py: the optimizer step alone at the parameter sets of train_step.py's dense (8 layers) and MoE
#     (4 layers) models, bf16 and fp32, torch fused + clip pass vs ours, block-size candidates;
# (3) train_step.py dense, 8 layers: bf16 and ours tensorwise + FP8 head, each with torch's AdamW and with "+tadam".
#   bash benchmarks/scripts/session15_b.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/tests $OUT/adamw $OUT/dense
timeout 90 python3 -m pytest -q --tb=short tests/test_adamw.py -p no:cacheprovider 2>&1 | tail -15 \
  | tee $OUT/tests/pytest_gpu.txt
timeout 150 python3 benchmarks/adamw.py --out $OUT/adamw 2>&1 | grep -v "Warning\|warn" | cut -c1-900
timeout 300 python3 benchmarks/train_step.py --out $OUT/dense --configs dense \
  --only bf16,bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head --steps 8 --warmup 3 --budget-s 250 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/dense/log.txt
grep -E "tok/s|ERROR|Error|x$" $OUT/dense/log.txt | cut -c1-200 | head -14
