#!/bin/bash
# Session 7, device call A (one H200):
# 1. the one-launch health statistics kernel against the torch reference on the GPU (tests/test_fp8_gpu.py -k health);
# 2. the FP8 grouped GEMM op bodies' host time, piece by piece (benchmarks/grouped_host.py);
# 3. fp8 vs bf16 linears at the two end-to-end models' smaller shapes (DeepSeek-MoE-16B at its 16384 tokens, Llama3-8B
#    wk and wo at 8192, torchao too there), for the size rule of the FP8 conversion filter;
# 4. the MoE training step: health kernel (default) vs reference ("+refhealth"), bf16, with a host profile per row.
# Run from the repo root on the device: bash benchmarks/scripts/session7_a.sh  ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/a $OUT/a/lin_ds $OUT/a/lin_8b
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_gpu.py -k health 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" > $OUT/a/pytest_gpu_health.txt; grep -E "^E |passed|failed|Error" $OUT/a/pytest_gpu_health.txt | head
timeout 90 python3 benchmarks/grouped_host.py --out $OUT/a 2>&1 | grep -v "Warning\|warn" | tee $OUT/a/grouped_host_log.txt | tail -16
timeout 110 python3 benchmarks/fp8_linear.py --out $OUT/a/lin_ds --m 16384 --shapes ds16b.attn ds16b.shared_w13 \
  ds16b.shared_w2 ds16b.dense_w13 ds16b.dense_w2 --impls bf16 ours_compiled --recipes tensorwise rowwise \
  --skip-numerics --skip-bandwidth --prewarm 10 --budget-s 95 2>&1 | grep -v "Warning\|warn" > $OUT/a/lin_ds/log.txt
tail -16 $OUT/a/lin_ds/log.txt | grep -v "_gw_hp"
timeout 100 python3 benchmarks/fp8_linear.py --out $OUT/a/lin_8b --m 8192 --shapes llama3_8b.wk llama3_8b.wo \
  --impls bf16 ours_compiled torchao --recipes tensorwise rowwise \
  --skip-numerics --skip-bandwidth --prewarm 10 --budget-s 85 2>&1 | grep -v "Warning\|warn" > $OUT/a/lin_8b/log.txt
tail -7 $OUT/a/lin_8b/log.txt | grep -v "_gw_hp"
timeout 230 python3 benchmarks/train_step.py --out $OUT/a --configs moe \
  --only bf16,ours:rowwise,ours:rowwise+refhealth \
  --steps 12 --warmup 2 --host-profile --budget-s 200 2>&1 | grep -v "optimizer probe\|Warning\|warn" > $OUT/a/moe_log.txt
grep -E "tok/s|idle|fp8 op cpu|ERROR" $OUT/a/moe_log.txt | cut -c1-250 | head -30
