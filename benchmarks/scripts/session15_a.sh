#!/bin/bash
# Session 15, device call A (one H200):
# (1) session 14's review fixes on the GPU: tests/test_host_memory_gpu.py and the product save/resume run of
#     session14_b.sh (page-locking in a short-lived thread on the caller's device, portable registration, checked
#     unregistration), unchanged script;
# (2) linear_host.py at Llama3-8B wo and wqkv: ours compiled with Inductor's static launcher for user-defined Triton
#     kernels, timed beside bf16, torchao and ours as shipped in one process.
#   bash benchmarks/scripts/session15_a.sh   ($OUT set by the device tool; carry .whl: torchao, hydra-core, omegaconf, antlr4)
bash benchmarks/scripts/session14_b.sh
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT/host
timeout 300 python3 benchmarks/linear_host.py --out $OUT/host --shapes llama3_8b.wo llama3_8b.wqkv \
  --variants "bf16" "torchao tensorwise" "ours tensorwise (transpose kernel)" "ours tensorwise (static launcher)" \
  "ours rowwise (cast kernels)" "ours rowwise (static launcher)" 2>&1 | grep -v "Warning\|warn" | tail -22
