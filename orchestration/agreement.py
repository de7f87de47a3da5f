"""One collective per step that merges every rank's verdict, so all ranks take the same decision.

`agree(verdict_D)` runs a single all_reduce(MAX) and a single device-to-host read. Each slot of the result
holds the maximum over ranks AND the rank that holds it, packed into one int64 per slot:

    key = (order_preserving_uint32(float32 value) << RANK_BITS) | (RANK_MASK - rank)

The map float32 -> uint32 is monotonic over all of float32 ordered by value (negative, -inf and +inf included),
so the integer MAX of the keys is the key of the largest value; its low bits name the rank (lowest rank on
ties, since the rank is stored inverted). The value comes back bit-exact. Integer MAX over int64 is supported by
gloo and NCCL alike, and the result is bit-identical on every rank, which is what keeps the host-side decisions
identical (no rank ever branches alone; that would deadlock NCCL).

NaN has no place in an order: the monitor already maps NaN statistics to flags/inf; `agree` maps any NaN left
to +inf as a last guard.

Legend: D = number of verdict slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from orchestration.monitor import MonitorReport, StepMonitor
    from orchestration.policy import Decision, DivergencePolicy

RANK_BITS = 20
RANK_MASK = (1 << RANK_BITS) - 1
_SIGN = 1 << 31
_LOW32 = (1 << 32) - 1
_INF = float("inf")


@dataclass(frozen=True)
class AgreedVerdict:
    """The verdict every rank agreed on: per slot the max over ranks and the rank holding it."""

    values: tuple[float, ...]
    ranks: tuple[int, ...]
    world_size: int = 1


def encode_keys(values_D: torch.Tensor, rank: int) -> torch.Tensor:
    """float32 values_D -> int64 keys_D whose integer order is the value order, rank in the low bits."""
    if not 0 <= rank <= RANK_MASK:
        raise ValueError(f"rank {rank} outside [0, {RANK_MASK}]: raise RANK_BITS for worlds this large")
    v_D = torch.nan_to_num(values_D.detach().to(torch.float32), nan=_INF, posinf=_INF, neginf=-_INF)
    bits_D = v_D.contiguous().view(torch.int32).to(torch.int64) & _LOW32  # raw IEEE bits as unsigned
    negative_D = bits_D >= _SIGN
    # Negative floats: flip all bits (larger magnitude -> smaller key); non-negative: set the sign bit.
    ordered_D = torch.where(negative_D, bits_D ^ _LOW32, bits_D | _SIGN)
    return (ordered_D << RANK_BITS) | (RANK_MASK - rank)


def decode_keys(keys_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of encode_keys: (float32 values_D, int64 ranks_D)."""
    ranks_D = RANK_MASK - (keys_D & RANK_MASK)
    ordered_D = keys_D >> RANK_BITS
    bits_D = torch.where(ordered_D >= _SIGN, ordered_D ^ _SIGN, ordered_D ^ _LOW32)
    bits_D = torch.where(bits_D >= _SIGN, bits_D - (1 << 32), bits_D)  # back into int32 range
    return bits_D.to(torch.int32).view(torch.float32), ranks_D


def agree(verdict_D: torch.Tensor, group: dist.ProcessGroup | None = None) -> AgreedVerdict:
    """Merge the verdicts of all ranks of `group`: one all_reduce(MAX) and one host read.

    Identity (world size 1, rank 0) when torch.distributed is not initialised. The tensor must live on the
    device the backend expects (CUDA for NCCL, CPU for gloo); StepMonitor.local_verdict builds it on the loss's
    device.
    """
    if verdict_D.dim() != 1:
        raise ValueError(f"verdict must be a 1-D tensor, got shape {tuple(verdict_D.shape)}")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    keys_D = encode_keys(verdict_D, rank)
    if distributed:
        dist.all_reduce(keys_D, op=dist.ReduceOp.MAX, group=group)
    values_D, ranks_D = decode_keys(keys_D)
    # One host read for both halves: float32 values are exact in float64, ranks < 2**20 too.
    host_2D = torch.stack([values_D.to(torch.float64), ranks_D.to(torch.float64)]).cpu()
    values, ranks = host_2D.tolist()
    return AgreedVerdict(values=tuple(values), ranks=tuple(int(r) for r in ranks), world_size=world)


class DivergenceGuard:
    """Convenience for the worker loop: detectors -> agreement -> evaluation -> policy, in one call per step.

    Call after backward (and after the grad norm is known), before optimizer.step(); apply the update only if
    `decision.applies_update`.
    """

    def __init__(self, monitor: StepMonitor, policy: DivergencePolicy, group: dist.ProcessGroup | None = None):
        self.monitor = monitor
        self.policy = policy
        self.group = group

    def check(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None = None,
        fp8_health: Mapping[str, torch.Tensor] | None = None,
        shadow: tuple[torch.Tensor, torch.Tensor] | None = None,
        layer_health: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[Decision, MonitorReport]:
        verdict_D = self.monitor.local_verdict(loss, grad_norm, fp8_health, shadow, layer_health)
        report = self.monitor.evaluate(agree(verdict_D, self.group), step)
        return self.policy.decide(report, step), report
