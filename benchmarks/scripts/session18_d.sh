#!/bin/bash
# Session 18, call D: the gated optimizer step without its host sync (call C's probe: the step counts'
# _foreach_add_ with a 0-d CUDA tensor; now a list of tensors). GPU tests of the gated AdamW step (no sync
# allowed); MoE 4 layers: bf16 vs ours gated (default) vs ours +nogate (the optimizer after the guard's read), and
# the host syncs of ours' step.
#   bash benchmarks/scripts/session18_d.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe
timeout 100 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider tests/test_adamw.py -k gpu > $OUT/tests.txt 2>&1
tail -2 $OUT/tests.txt
timeout 330 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nogate --steps 12 --warmup 3 \
  --sync-probe --budget-s 300 2>&1 | grep -v "optimizer probe\|Warning\|warn(" > $OUT/moe/log.txt
grep -E "sync x|tok/s|ERROR|Error|x$" $OUT/moe/log.txt | cut -c1-300 | head -16
