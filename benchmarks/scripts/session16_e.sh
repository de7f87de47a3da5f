#!/bin/bash
# Session 16, device call E (one H200): the product loop (orchestration.torchrun: fp32 master weights under bf16
# autocast, monitors, guard, checkpoints) with the FP8 head's loss fused (precision.fp8_head_fused_loss=true, the
# default) and unfused, and bf16; DeepSeek-MoE-16B width, 4 layers, 16384 tokens a step, our AdamW (train.adamw=auto).
#   bash benchmarks/scripts/session16_e.sh   ($OUT set by the device tool; carry .whl: hydra-core, omegaconf, antlr4)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
mkdir -p $OUT/moe
timeout 400 python3 benchmarks/worker_throughput.py --out $OUT/moe --run-root $ROOT --timeout-s 125 --skip-steps 8 \
  --common model=deepseek_moe16b +model.overrides.n_layers=4 data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=4 train.steps=20 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 \
    checkpoint.every_steps=100 cluster.device=cuda cluster.min_workers=1 cluster.max_workers=1 \
    cluster.gpus_per_worker=1 \
  --variant fp8_head_fused precision=fp8 precision.fp8_output_head=true \
  --variant fp8_head_unfused precision=fp8 precision.fp8_output_head=true precision.fp8_head_fused_loss=false \
  --variant bf16 precision=bf16 2>&1 | grep -v "checkpoint_good" | tail -12
python3 -c "
import json; r = json.load(open('$OUT/moe/worker_throughput.json'))
for v in r['results']: print(v['name'], v.get('tokens_per_s_median'))"
for d in $ROOT/*/; do python3 -c "
import json,sys; ms=[json.loads(l) for l in open('$d/metrics.jsonl')]
print('$d', [(m['step'], round(m['loss'],4)) for m in ms][-3:])" 2>/dev/null; done
grep -h -E "Error|Traceback" $OUT/moe/*.log 2>/dev/null | head -8
