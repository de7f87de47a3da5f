#!/bin/bash
# Session 13, device call A (one H200):
# (1) grouped-GEMM probe: each fp8 dgrad / wgrad grouped GEMM of the DeepSeek-MoE-16B experts alone, with fast
#     accumulation and with its output dim padded to a multiple of 256 (w2's 1408: the fp8 dgrad that ran at 0.59x
#     of bf16 in session 2, so "auto" keeps it in bf16);
# (2) the MoE product loop, bf16 / fp8 / fp8 + FP8 head in ONE call (session 12 measured them on two machines, after
#     fixing the bf16 experts' fp32 compute), with each checkpoint's time breakdown (state/write/hash/finalize).
#   bash benchmarks/scripts/session13_a.sh   ($OUT set by the device tool; carry .whl: hydra-core, omegaconf, antlr4)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
mkdir -p $OUT/moe $OUT/grouped
timeout 120 python3 benchmarks/moe_grouped.py --out $OUT/grouped --skip-numerics --cases bf16_compiled \
  --breakdown --budget-s 100 2>&1 | grep -v "^{" | tail -40
timeout 440 python3 benchmarks/worker_throughput.py --out $OUT/moe --run-root $ROOT --timeout-s 145 --skip-steps 10 \
  --common model=deepseek_moe16b +model.overrides.n_layers=4 data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=4 train.steps=24 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 \
    cluster.device=cuda cluster.min_workers=1 cluster.max_workers=1 cluster.gpus_per_worker=1 \
  --variant bf16 precision=bf16 --variant fp8 precision=fp8 \
  --variant fp8_head precision=fp8 precision.fp8_output_head=true 2>&1 | grep -v "checkpoint_good"
python3 -c "
import json; r = json.load(open('$OUT/moe/worker_throughput.json'))
for v in r['results']: print(v['name'], v.get('tokens_per_s_median'), v.get('checkpoint_timing'))"
grep -h -E "Error|Traceback" $OUT/moe/*.log | head -8
cd $OUT && tar czf runs.tgz moe && rm -rf moe
