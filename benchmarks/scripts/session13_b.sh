#!/bin/bash
# Session 13, device call B (one H200):
# (1) the GPU tests never run on a GPU: the FP8 output head (session 10) and the fast-accumulation grad input of the
#     grouped GEMM (dgrad="fp8_fast", this session);
# (2) background checkpoints in the product loop: the MoE model of call A at 2 layers (DeepSeek-MoE-16B width, fp8 +
#     FP8 head, ~13 GB of state a save; 4 layers would overflow the 128 GB tmpfs + pinned host memory), 24 steps,
#     periodic saves at 8 and 16, keep_last=2 keep_good=1, with checkpoint.async_save=never vs
#     always in one call: training stall per save and throughput while a save is written.
#   bash benchmarks/scripts/session13_b.sh   ($OUT set by the device tool; carry .whl: hydra-core, omegaconf, antlr4)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
mkdir -p $OUT/ckpt $OUT/tests
timeout 150 python3 -m pytest -q tests/test_fp8_gpu.py -k "output_head or fast_accum" -p no:cacheprovider 2>&1 \
  | tail -15 | tee $OUT/tests/pytest_gpu.txt
timeout 400 python3 benchmarks/worker_throughput.py --out $OUT/ckpt --run-root $ROOT --timeout-s 195 --skip-steps 4 \
  --common model=deepseek_moe16b +model.overrides.n_layers=2 data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=4 train.steps=24 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 \
    checkpoint.every_steps=8 checkpoint.keep_last=2 checkpoint.keep_good=1 precision=fp8 precision.fp8_output_head=true \
    cluster.device=cuda cluster.min_workers=1 cluster.max_workers=1 cluster.gpus_per_worker=1 \
  --variant sync_saves checkpoint.async_save=never --variant async_saves checkpoint.async_save=always 2>&1 \
  | grep -v "checkpoint_good"
python3 -c "
import json; r = json.load(open('$OUT/ckpt/worker_throughput.json'))
for v in r['results']:
    print(v['name'], 'tok/s lines', v.get('tokens_per_s_lines'))
    for t in v.get('checkpoint_timing', []): print('   ', t)"
grep -h -E "Error|Traceback" $OUT/ckpt/*.log | head -8
cd $OUT && tar czf runs.tgz ckpt && rm -rf ckpt
