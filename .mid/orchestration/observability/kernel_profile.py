"""Where a training step's time goes: a torch.profiler table grouped into categories (GEMMs, FP8 casts, attention,
optimizer, ...) and the rest of the step's wall time, when no kernel ran. Pure: rows in, numbers out.

Rows are {"kernel", "us_per_step", "calls_per_step"} and optionally "category" (when "kernel" is a shortened name):
GPU kernels on a GPU, the self time of torch's operators on a CPU device (aten::mm, ...).
orchestration/training/profiling.py makes them from the product loop, benchmarks/train_step.py from the isolated step.
"""

from __future__ import annotations

import re
from typing import Any

# The first pattern that matches a (lower-cased) name decides its category. cuBLASLt/CUTLASS names say e4m3/e5m2/f8
# for FP8 GEMMs, and cuBLASLt's nvjet kernels their operand types (on an H100: nvjet_sm90_tst_... for bf16,
# nvjet_sm90_qqtst_... for e4m3 x e4m3 and qrtst_... for e4m3 x e5m2, the gradient GEMMs); Inductor's fused kernels
# name the ops they fuse (triton_red_fused_abs_amax_... is a cast's amax, triton_per_fused_..._rsqrt a norm); on a CPU
# device the names are torch's operators.
KERNEL_CATEGORIES = (
    ("communication", r"nccl|all_?gather|reduce_?scatter|all_?reduce|c10d"),
    ("attention", r"flash|fmha|attention|sdpa|_attn"),
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    # Our Triton casts (fp8/kernels) and Inductor's fused ones (amax, then clamp before the fp8 conversion). Never a
    # CUTLASS kernel: those are GEMMs, whose template arguments (epilogue broadcasts, scale and clamp types) can name
    # any of these words; torch's grouped GEMMs (GroupProblemShape) were once counted here as casts.
    ("fp8_cast_amax", r"^(?!.*cutlass).*(amax|(?<!broad)cast|quant|rowwise|tensorwise|clamp)"),
    ("grouped_gemm", r"group"),
    ("fp8_gemm", r"e4m3|e5m2|f8f8|fp8|scaled_mm|nvjet_sm\d+_[qr][qr]"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm80_|aten::(mm|addmm|bmm|baddbmm)$"),
    ("cross_entropy_head", r"_ce_|cross_entropy|log_softmax|nll_loss|logsumexp"),
    ("moe_routing", r"sort|topk|histc|bincount|cumsum|index|scatter|gather|permute"),
    ("memcpy_memset", r"memcpy|memset"),
    ("norm_elementwise", r"."),
)


def category_of(name: str) -> str:
    """The category of one kernel or operator name (KERNEL_CATEGORIES)."""
    lowered = name.lower()
    return next(category for category, pattern in KERNEL_CATEGORIES if re.search(pattern, lowered))


def kernel_breakdown(rows: list[dict[str, Any]], step_ms: float) -> dict[str, dict[str, float]]:
    """Busy time per category for one step, in ms and as a share of the step's wall time step_ms; `idle` is the rest
    of the step, when nothing ran (on a GPU: host work, launch gaps, synchronisations). Kernels of several streams
    that ran at once (NCCL beside compute) are counted in full, so idle is then a lower bound."""
    per_category: dict[str, float] = {name: 0.0 for name, _ in KERNEL_CATEGORIES}
    for row in rows:
        per_category[row.get("category") or category_of(row["kernel"])] += row["us_per_step"] / 1e3
    out = {c: {"ms": round(ms, 3), "share": round(ms / step_ms, 4)} for c, ms in per_category.items() if ms > 0}
    idle = max(step_ms - sum(per_category.values()), 0.0)
    out["idle"] = {"ms": round(idle, 3), "share": round(idle / step_ms, 4)}
    return out
