#!/bin/bash
# Session 12, device call A (one H200): the product's own loop (orchestration.torchrun: FSDP2 with fp32 master
# weights, byte-level stdlib data, monitors, guard, checkpoints) on the GPU for the first time.
# (1) Llama3-8B width, 4 layers, seq 8192, batch 1: bf16 vs fp8 (default recipe), tokens/s from metrics.jsonl.
# (2) debug_moe in fp8 with a persistent loss spike at step 30: skip, bf16 fallback, rollback to step 20, on the GPU.
# Needs hydra-core, omegaconf, antlr4 wheels in .whl (the image lacks them). Run from the repo root:
#   bash benchmarks/scripts/session12_a.sh   ($OUT set by the device tool)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
df -h /tmp /dev/shm | tail -2
# Checkpoints of the 4-layer 8B-width model are ~23 GB each (fp32 weights + AdamW): on tmpfs when it has room.
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
echo "run root $ROOT"
mkdir -p $OUT/dense $OUT/fault
timeout 420 python3 benchmarks/worker_throughput.py --out $OUT/dense --run-root $ROOT --timeout-s 200 --skip-steps 12 \
  --common model=llama3_8b +model.overrides.n_layers=4 data.seq_len=8192 train.micro_batch_size=1 \
    train.global_batch_size=1 train.steps=30 train.warmup_steps=5 train.log_every=2 cluster.device=cuda \
    cluster.min_workers=1 cluster.max_workers=1 cluster.gpus_per_worker=1 \
  --variant bf16 precision=bf16 --variant fp8 precision=fp8 2>&1 | grep -v "^\s*{\"event\": \"checkpoint_good"
timeout 130 python3 benchmarks/worker_throughput.py --out $OUT/fault --run-root $ROOT --timeout-s 125 --skip-steps 10 \
  --common model=debug_moe precision=fp8 train.steps=60 train.global_batch_size=8 data.seq_len=64 train.log_every=1 \
    checkpoint.every_steps=10 monitor.good_after_steps=5 cluster.device=cuda cluster.min_workers=1 \
    cluster.max_workers=1 cluster.gpus_per_worker=1 \
  --variant spike faults=loss_spike faults.rank=0 faults.step=30 faults.num_steps=3 2>&1 | cut -c1-260
for d in dense fault; do tail -30 $OUT/$d/*.log | grep -E "Error|error|Traceback|status|tokens/s" | head -12; done
cd $OUT && tar czf runs.tgz dense fault && rm -rf dense fault
