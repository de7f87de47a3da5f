#!/bin/bash
# Session 13, device call C (one H200):
# (1) the MoE training step (train_step.py, DeepSeek-MoE-16B width, 4 layers, 16384 tokens): bf16, ours tensorwise +
#     FP8 head with the new grouped grad-input default (dgrad="auto" = fp8 with fast accumulation) and with the
#     sessions 4-12 default (+widthdg: bf16 for w2, promoted fp8 for w13), one run;
# (2) the grouped experts alone (moe_grouped.py): bf16, ours (hp weight gradient) new default and old ("width"),
#     with the numerics table (SQNR vs float64);
# (3) synchronous saves written from the pinned host copy (async_save=always: step 0 and the final save are
#     synchronous and staged; 2 MoE layers, 12 steps, a periodic background save at 6).
#   bash benchmarks/scripts/session13_c.sh   ($OUT set by the device tool; carry .whl: hydra-core, omegaconf, antlr4)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
mkdir -p $OUT/moe $OUT/grouped $OUT/ckpt
timeout 290 python3 benchmarks/train_step.py --out $OUT/moe --configs moe \
  --only bf16,ours:tensorwise+head,ours:tensorwise+head+widthdg --steps 8 --warmup 3 --budget-s 260 2>&1 \
  | grep -v "optimizer probe\|Warning\|warn" > $OUT/moe/log.txt
grep -E "tok/s|ERROR|Error|memory|x$" $OUT/moe/log.txt | cut -c1-200 | head -12
timeout 110 python3 benchmarks/moe_grouped.py --out $OUT/grouped --cases bf16_compiled ours_hp_compiled \
  ours_hp_w_compiled --budget-s 95 2>&1 | grep -v "^{" | tail -8
timeout 130 python3 benchmarks/worker_throughput.py --out $OUT/ckpt --run-root $ROOT --timeout-s 120 --skip-steps 2 \
  --common model=deepseek_moe16b +model.overrides.n_layers=2 data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=4 train.steps=12 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 \
    checkpoint.every_steps=6 checkpoint.keep_last=2 checkpoint.keep_good=1 precision=fp8 precision.fp8_output_head=true \
    cluster.device=cuda cluster.min_workers=1 cluster.max_workers=1 cluster.gpus_per_worker=1 \
  --variant staged checkpoint.async_save=always 2>&1 | grep -v "checkpoint_good" | tail -3
python3 -c "
import json; r = json.load(open('$OUT/ckpt/worker_throughput.json'))
for v in r['results']:
    for t in v.get('checkpoint_timing', []): print('   ', t)"
cd $OUT && tar czf runs.tgz ckpt && rm -rf ckpt
