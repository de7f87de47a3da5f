"""Whether FP8 pays for a GEMM of a given size: small GEMMs lose more to their casts than FP8 saves.

An FP8 linear halves its GEMM time but adds casts (amax, scale, quantize, transposes) whose cost grows with the
operands, not with the FLOPs, and a fixed launch overhead. Below some size the GEMM saving no longer covers them,
and the layer is faster left in bf16. The boundary is measured per device by benchmarks/fp8_size_rule.py
(fwd + bwd of one compiled linear and of one group of routed experts, bf16 against FP8, over sizes); the rule
below is read off that sweep (BENCHMARKS.md, "Where FP8 pays").

Legend: M rows (tokens through a linear; rows routed to one expert on average for a grouped GEMM), K in_features,
N out_features.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SizeRule:
    """FP8 pays for a GEMM when its forward FLOPs (2 M K N) reach min_gflop and both weight dims reach min_dim."""

    min_gflop: float
    min_dim: int

    def pays(self, m: int, k: int, n: int) -> bool:
        return 2.0 * m * k * n >= self.min_gflop * 1e9 and min(k, n) >= self.min_dim


# Read off benchmarks/results/fp8_size_rule.json and mission_moe.json (H100, tensorwise; BENCHMARKS.md "Where FP8
# pays"). Routed experts are GPU-bound even alone, so their sweep's crossover is the rule: FP8 loses below about
# 1536 rows per expert at DeepSeek-MoE-16B's sizes and wins above. A lone linear is host-bound below a few hundred
# GFLOP (a fixed launch cost the FP8 layer pays and a compiled block hides), so its sweep over-states the loss: the
# rule sits under the smallest linears that the whole product step runs in FP8 at a gain (the 2048 x 2048 attention
# projections at 16k tokens, 137 GFLOP) and above every linear of the 16 x 128-token step FP8 lost at.
LINEAR_RULE = SizeRule(min_gflop=100.0, min_dim=0)
EXPERT_GROUP_RULE = SizeRule(min_gflop=8.0, min_dim=0)


def linear_pays(tokens: int, in_features: int, out_features: int, rule: SizeRule | None = None) -> bool:
    return (rule or LINEAR_RULE).pays(tokens, in_features, out_features)


def expert_group_pays(tokens: int, top_k: int, n_experts: int, dim: int, hidden: int,
                      rule: SizeRule | None = None) -> bool:
    """A group of routed experts (each one's w13: dim -> 2 hidden, w2: hidden -> dim) at `tokens` tokens routed
    top_k of n_experts: judged on the average rows per expert and its smaller GEMM (w2)."""
    rows = tokens * top_k // n_experts
    return (rule or EXPERT_GROUP_RULE).pays(rows, hidden, dim)
