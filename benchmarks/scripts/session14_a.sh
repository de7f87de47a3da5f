#!/bin/bash
# Session 14, device call A (one H200):
# (1) pinned_staging.py: pinned host buffers for a 13 GiB checkpoint by cudaHostAlloc (torch pin_memory) and by
#     cudaHostRegister of touched pageable memory, each in a thread beside a GPU matmul loop (what the first
#     background save's 7.7 s stall could become);
# (2) linear_host.py on Llama3-8B wo and wqkv: host us / wall / GPU ms of one compiled fwd+bwd, bf16, torchao
#     tensorwise and ours (session 8's fixed script, not run since), plus ours without health statistics (probe).
#   bash benchmarks/scripts/session14_a.sh   ($OUT set by the device tool; carry .whl: torchao)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/pin $OUT/host
timeout 150 python3 benchmarks/pinned_staging.py --out $OUT/pin --gib 13 2>&1 | tail -12
timeout 400 python3 benchmarks/linear_host.py --out $OUT/host --shapes llama3_8b.wo llama3_8b.wqkv 2>&1 \
  | grep -v "Warning\|warn" | tail -22
