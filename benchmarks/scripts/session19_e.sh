#!/bin/bash
# Prepared in session 19 (NOT RUN: no device lent). The product loop (worker_throughput.py, the worker's own step with
# fp32 master weights), MoE 4 layers: fp8 with the defaults, fp8 with the
# session-19 options (fp8_keep, unpadded token groups: keep only what session19_a/b showed correct and faster), bf16.
# Session 18 call E: fp8 148,155 vs bf16 125,546 tokens/s = 1.180x.
#   bash benchmarks/scripts/session19_e.sh   ($OUT set by the device tool; carry .whl for hydra, omegaconf)
source benchmarks/scripts/product_loop_prelude.sh
mkdir -p $OUT/loop
timeout 420 python3 benchmarks/worker_throughput.py --out $OUT/loop --run-root $ROOT --timeout-s 125 --skip-steps 8 \
  --common model=deepseek_moe16b +model.overrides.n_layers=4 data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=4 train.steps=20 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 \
    checkpoint.every_steps=100 cluster.device=cuda cluster.min_workers=1 cluster.max_workers=1 \
    cluster.gpus_per_worker=1 \
  --variant fp8 precision=fp8 precision.fp8_output_head=true \
  --variant fp8_s19 precision=fp8 precision.fp8_output_head=true precision.moe_dgrad=fp8_keep \
    precision.moe_token_group_align=1 \
  --variant bf16 precision=bf16 2>&1 | grep -v "checkpoint_good" | tail -8
python3 -c "
import json; r = json.load(open('$OUT/loop/worker_throughput.json'))
for v in r['results']: print(v['name'], v.get('tokens_per_s_median'))"
grep -h -E "Error|Traceback" $OUT/loop/*.log 2>/dev/null | head -8
