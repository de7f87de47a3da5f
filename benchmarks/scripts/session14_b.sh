#!/bin/bash
# Session 14, device call B (one H200):
# (1) GPU tests of the registered host staging buffers (tests/test_host_memory_gpu.py);
# (2) the product loop with checkpoint.async_save=always and staging buffers page-locked by cudaHostRegister: the
#     model of session 13 call B (DeepSeek-MoE-16B width, 2 layers, fp8 + FP8 head, ~13 GB a save), a run of 16 steps
#     (saves: 0 synchronous, 8 background, 16 final) and the same run resumed to 32 steps (buffers prepared in the
#     background after the load; saves 24 background, 32 final). Session 13: step-0 save 12.9 s (8.6 s pinning),
#     first background save stalled 7.7 s.
#   bash benchmarks/scripts/session14_b.sh (call C re-ran it after the arena change)   ($OUT set by the device tool; carry .whl: hydra-core, omegaconf, antlr4)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
mkdir -p $OUT/tests $OUT/run
timeout 100 python3 -m pytest -q --tb=short tests/test_host_memory_gpu.py -p no:cacheprovider 2>&1 | tail -40 \
  | tee $OUT/tests/pytest_gpu.txt
RUN=resume-$(date +%s)
COMMON="model=deepseek_moe16b +model.overrides.n_layers=2 data.seq_len=4096 train.micro_batch_size=4
  train.global_batch_size=4 train.warmup_steps=5 train.lr=3e-4 train.log_every=2 checkpoint.every_steps=8
  checkpoint.keep_last=2 checkpoint.keep_good=1 precision=fp8 precision.fp8_output_head=true cluster.device=cuda
  cluster.min_workers=1 cluster.max_workers=1 cluster.gpus_per_worker=1 checkpoint.async_save=always
  run_name=$RUN run_root=$ROOT"
for steps in 16 32; do
  t0=$(date +%s.%N)
  timeout 220 python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m orchestration.torchrun $COMMON \
    train.steps=$steps > $OUT/run/steps$steps.log 2>&1
  echo "run to step $steps: rc=$? wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
done
python3 - <<PY
import json
ev = [json.loads(l) for l in open("$ROOT/$RUN/events.jsonl")]
for e in ev:
    if e["event"] in ("checkpoint_timing", "resume", "run_start", "run_end", "worker_group_start"):
        print({k: v for k, v in e.items() if k not in ("time", "recipe", "device", "backend")})
ms = [json.loads(l) for l in open("$ROOT/$RUN/metrics.jsonl")]
print("tokens/s by step:", [(m["step"], round(m["tokens_per_s"])) for m in ms])
PY
grep -h -E "Error|Traceback" $OUT/run/*.log | head -8
rm -rf $ROOT/$RUN/checkpoints; cp $ROOT/$RUN/*.jsonl $ROOT/$RUN/summary.json $OUT/run/ 2>/dev/null
