#!/bin/bash
# Session 12, device call D (one H200): call C's bf16 row again after the grouped-GEMM autocast fix (the bf16 experts had run in fp32). The product loop on the MoE model - DeepSeek-MoE-16B width, 4 layers (1 dense
# + 3 MoE, 64 routed experts top-6, 2 shared), seq 4096 x batch 4 = 16384 tokens a step (train_step.py's MoE shape),
# fp32 master weights, lr 3e-4: bf16, fp8 (default recipe), fp8 + FP8 output head.
#   bash benchmarks/scripts/session12_c.sh   ($OUT set by the device tool; .whl carried: hydra-core, omegaconf, antlr4)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
mkdir -p $OUT/moe
timeout 200 python3 benchmarks/worker_throughput.py --out $OUT/moe --run-root $ROOT --timeout-s 190 --skip-steps 10 \
  --common model=deepseek_moe16b +model.overrides.n_layers=4 data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=4 train.steps=24 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 \
    cluster.device=cuda cluster.min_workers=1 cluster.max_workers=1 cluster.gpus_per_worker=1 \
  --variant bf16 precision=bf16 2>&1 | grep -v "checkpoint_good"
grep -h -E "Error|Traceback" $OUT/moe/*.log | head -8
cd $OUT && tar czf runs.tgz moe && rm -rf moe
