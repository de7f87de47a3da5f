#!/bin/bash
# Session 18, call B: (1) GPU tests of this session's changes (the gated AdamW step, the agreement's non-blocking
# read, the group-scaled row cast's one-group path and bf16 multipliers, the fused head after session 17's review
# fixes); (2) MoE 4 layers: bf16 vs ours with the optimizer step gated before the guard's host read (default now)
# and without (+nogate), host profiles for the idle; (3) loss parity 150 steps: bf16, ours fused head, ours unfused
# head (is call A's +0.92% the new loss kernels or run-to-run drift?); (4) the fp8_reuse kernels' sweep, timed back
# to back (call A's one-call timings included ~0.3-0.8 ms of host launch work).
#   bash benchmarks/scripts/session18_b.sh   ($OUT set by the device tool; nothing to carry)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/moe $OUT/loss $OUT/reuse
timeout 150 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider \
  "tests/test_fp8_gpu.py::test_group_scaled_row_cast_matches_reference_on_gpu" \
  "tests/test_fp8_gpu.py::test_grouped_fast_accum_grad_input_keeps_fp8_accuracy" \
  tests/test_adamw.py tests/test_agreement.py -k "gpu or sync or group_scaled or fast_accum" \
  > $OUT/tests.txt 2>&1
timeout 60 python3 -m pytest -q --tb=short -W ignore -p no:cacheprovider -k test_gpu tests/test_fp8_head.py \
  >> $OUT/tests.txt 2>&1
tail -4 $OUT/tests.txt
timeout 300 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16+tadam,ours:tensorwise+head+tadam,ours:tensorwise+head+tadam+nogate --steps 12 --warmup 3 \
  --host-profile --budget-s 260 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|x$|idle" $OUT/moe/log.txt | cut -c1-200 | head -16
timeout 150 python3 benchmarks/train_step.py --out $OUT/loss --configs loss --loss-steps 150 --loss-vocab pairs \
  --loss-variants bf16,ours:tensorwise+head,ours:tensorwise+head+nofce 2>&1 | grep -E "^\[loss\]|^loss|Error" | head -8
timeout 90 python3 benchmarks/reuse_kernels.py --out $OUT/reuse 2>&1 | grep -v "Warning\|warn" > $OUT/reuse/log.txt
cut -c1-110 $OUT/reuse/log.txt
