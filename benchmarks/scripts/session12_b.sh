#!/bin/bash
# Session 12, device call B (one H200): the product loop after call A's findings - weights initialised on the GPU
# unit by unit (no host copy), checkpoints written by 8 threads and hashed in parallel 64 MiB chunks - and with a
# learning rate fit for the 8B width (3e-4; call A's 3e-3 made the bf16 loss jump to 31 and tripped the fp8
# amax-growth detector at step 20). (1) Llama3-8B width, 4 layers, seq 8192, batch 1: bf16, fp8, fp8 + FP8 head.
# (2) debug_moe fp8 with a persistent loss spike at step 30 (skip, fallback, rollback), with room to recompile.
#   bash benchmarks/scripts/session12_b.sh   ($OUT set by the device tool; .whl carried: hydra-core, omegaconf, antlr4)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
mkdir -p $OUT/dense $OUT/fault
GPU1="cluster.device=cuda cluster.min_workers=1 cluster.max_workers=1 cluster.gpus_per_worker=1"
timeout 340 python3 benchmarks/worker_throughput.py --out $OUT/dense --run-root $ROOT --timeout-s 150 --skip-steps 12 \
  --common model=llama3_8b +model.overrides.n_layers=4 data.seq_len=8192 train.micro_batch_size=1 \
    train.global_batch_size=1 train.steps=30 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 $GPU1 \
  --variant bf16 precision=bf16 --variant fp8 precision=fp8 \
  --variant fp8_head precision=fp8 precision.fp8_output_head=true 2>&1 | grep -v "checkpoint_good"
timeout 235 python3 benchmarks/worker_throughput.py --out $OUT/fault --run-root $ROOT --timeout-s 230 --skip-steps 10 \
  --common model=debug_moe precision=fp8 train.steps=60 train.global_batch_size=8 data.seq_len=64 train.log_every=1 \
    checkpoint.every_steps=10 monitor.good_after_steps=5 $GPU1 \
  --variant spike faults=loss_spike faults.rank=0 faults.step=30 faults.num_steps=3 2>&1 | cut -c1-260
grep -h -E "Error|Traceback" $OUT/dense/*.log $OUT/fault/*.log | head -8
cd $OUT && tar czf runs.tgz dense fault && rm -rf dense fault
