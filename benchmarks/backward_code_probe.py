"""Which calls the compiled forward + backward of a tensorwise Float8Linear makes for its fp8 transposes (GPU).

    PYTHONUNBUFFERED=1 python3 benchmarks/backward_code_probe.py

Why: a lone compiled wo layer spent ~290 us of host per fwd+bwd on its three transposes where one launch of our
transpose kernel from Inductor's code costs ~11 us more than Inductor's own (linear_host.py, session 14). This prints
every line of the generated code that mentions the transpose or the elastic_fp8 ops, graph by graph.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch._inductor.utils import run_and_get_code

import fp8


def main() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).cuda().to(torch.bfloat16)  # root: not replaced
    fp8.convert_to_fp8(model, "tensorwise", module_filter=lambda m, fqn: True)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(model)

    def step():
        compiled(x).float().square().mean().backward()

    _, codes = run_and_get_code(step)
    for i, code in enumerate(codes):
        lines = [ln.rstrip() for ln in code.splitlines()
                 if ("transpose" in ln or "elastic_fp8" in ln or "extern_kernels" in ln) and not ln.strip().startswith("#")]
        print(f"--- graph {i}: {len(code.splitlines())} lines, {len(lines)} of interest")
        for ln in lines[:40]:
            print("   ", ln[:200])


if __name__ == "__main__":
    main()
