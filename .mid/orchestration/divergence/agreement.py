"""One collective per step that merges every rank's verdict, so all ranks take the same decision.

`agree(verdict_D)` runs a single all_reduce(MAX) and a single device-to-host read (agree_on_device, then the read;
agree_and_decide puts a gated optimizer launch between the two). Each slot of the result
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

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from orchestration.divergence.monitor import AgreedVerdict, MonitorReport, StepMonitor
from orchestration.divergence.policy import Decision, DivergencePolicy

RANK_BITS = 20
RANK_MASK = (1 << RANK_BITS) - 1
_SIGN = 1 << 31
_LOW32 = (1 << 32) - 1
_INF = float("inf")


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


def agree_on_device(verdict_D: torch.Tensor, group: dist.ProcessGroup | None = None) -> AgreementOnDevice:
    """The collective half of agree(): the agreed values and their ranks, still on the device (no host read).

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
    return AgreementOnDevice(values_D=values_D, ranks_D=ranks_D, world_size=world)


@dataclass(frozen=True)
class AgreementOnDevice:
    values_D: torch.Tensor  # float32, NaN-free (encode_keys maps NaN to +inf)
    ranks_D: torch.Tensor  # int64
    world_size: int

    def start_read(self, gate: torch.Tensor | None = None, extra_D: torch.Tensor | None = None) -> PendingAgreement:
        """Start the one host read (of the values, their ranks, an optional 0-d update gate and optional extra agreed
        values), without waiting."""
        return PendingAgreement(self, gate, extra_D)


@dataclass
class StopRequest:
    """A request to save a checkpoint and stop (SIGTERM), carried by the step's one agreement as an extra slot:
    set `local` on any rank before the step (or override `asked`, which the agreement reads); after its agreement,
    `agreed` is True on every rank when any asked."""

    local: bool = False
    agreed: bool = False

    def asked(self) -> bool:
        """Whether this rank asks now: read once per step, just before the agreement."""
        return self.local


class PendingAgreement:
    """The agreed verdict on its way to the host: a non-blocking copy into pinned memory, so that work queued
    after it (the gated optimizer step) does not delay `result()`, which waits for that copy alone."""

    def __init__(self, agreement: AgreementOnDevice, gate: torch.Tensor | None, extra_D: torch.Tensor | None = None):
        parts = [agreement.values_D.to(torch.float64), agreement.ranks_D.to(torch.float64)]
        if gate is not None:
            parts.append(gate.detach().reshape(1).to(torch.float64))
        if extra_D is not None:
            parts.append(extra_D.to(torch.float64))
        self.extra: tuple[float, ...] = ()  # the extra values, once result() has read them
        # One copy for all of it: float32 values are exact in float64, ranks < 2**20 and the 0/1 gate too.
        packed = torch.cat(parts)
        self._n = agreement.values_D.numel()
        self._world = agreement.world_size
        self._has_gate = gate is not None
        self._done: torch.cuda.Event | None = None
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(packed.device))  # the copy's stream, whatever the current device
        else:
            self._host = packed

    def result(self) -> tuple[AgreedVerdict, float | None]:
        """(the agreed verdict, the gate's value or None): blocks until the copy has landed."""
        if self._done is not None:
            self._done.synchronize()
        flat = self._host.tolist()
        n = self._n
        self.extra = tuple(flat[2 * n + self._has_gate:])
        agreed = AgreedVerdict(values=tuple(flat[:n]), ranks=tuple(int(r) for r in flat[n:2 * n]),
                               world_size=self._world)
        return agreed, (flat[2 * n] if self._has_gate else None)


def agree(verdict_D: torch.Tensor, group: dist.ProcessGroup | None = None) -> AgreedVerdict:
    """Merge the verdicts of all ranks of `group`: one all_reduce(MAX) and one host read (see agree_on_device)."""
    return agree_on_device(verdict_D, group).start_read().result()[0]


def agree_stop_alone(stop: StopRequest, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """The stop request's agreement for a step without the divergence check (monitor.enabled=false): the only
    collective such a step has for it."""
    stop.agreed = agree(torch.tensor([float(stop.asked())], device=device), group).values[0] > 0


def agree_and_decide(monitor: StepMonitor, policy: DivergencePolicy, verdict_D: torch.Tensor, step: int,
                     group: dist.ProcessGroup | None = None,
                     gated_update: Callable[[torch.Tensor], bool] | None = None,
                     stop: StopRequest | None = None) -> tuple[Decision, MonitorReport, bool]:
    """Agreement -> evaluation -> policy for one step: (decision, report, whether the update was applied here).

    gated_update(gate): optional; launches the step's update so that it takes effect only where the 0-d device
    tensor `gate` is 1 (optim.ChunkedAdamW.clip_and_step(..., gate=)), returning False if its optimizer step could
    not be (the caller then steps after the decision, as without it); the third value says whether it was. The gate
    is what the policy will decide about applying the update, computed on the device from the agreed values before
    the host has read them (StepMonitor.update_gate: the same thresholds, compared in the same float64, as
    evaluate()). It is launched
    before the host read and the read does not wait for it, so the GPU runs the optimizer while the host evaluates
    (without it the GPU idled from the read until the host had decided and launched the optimizer, in the MoE host
    profile). A gate that disagrees with the decision is a bug: RuntimeError.

    stop: optional; its request rides in the same all-reduce as one more slot (MAX: any rank asking stops all) and
    comes back in the same host read, so a SIGTERM costs no collective of its own.
    """
    n = verdict_D.numel()
    if stop is not None:
        verdict_D = torch.cat([verdict_D, verdict_D.new_tensor([float(stop.asked())], dtype=verdict_D.dtype)])
    full = agree_on_device(verdict_D, group)
    on_device = AgreementOnDevice(full.values_D[:n], full.ranks_D[:n], full.world_size) if stop is not None else full
    gate = None
    if gated_update is not None and not policy.stopped:
        gate = monitor.update_gate(on_device.values_D, consider_fp8=policy.acts_on_fp8_findings)
    pending = on_device.start_read(gate, full.values_D[n:] if stop is not None else None)
    launched = gate is not None and gated_update(gate)
    agreed, gate_value = pending.result()
    if stop is not None:
        stop.agreed = pending.extra[0] > 0
    report = monitor.evaluate(agreed, step)
    decision = policy.decide(report, step)
    # Checked whether or not the optimizer could take the gate (the router's update always does).
    if gate_value is not None and (gate_value == 1.0) != decision.applies_update:
        raise RuntimeError(f"step {step}: the device gate ({gate_value}) launched with the update disagrees with the "
                           f"policy's decision {decision!r} (applies_update={decision.applies_update}); the "
                           "weights may have been updated by a step the policy rejected")
    return decision, report, launched and decision.applies_update


class DivergenceGuard:
    """Convenience for the worker loop: detectors -> agreement -> evaluation -> policy, in one call per step.

    Call after backward (and after the grad norm is known), before optimizer.step(); apply the update only if
    `decision.applies_update`.
    """

    def __init__(self, monitor: StepMonitor, policy: DivergencePolicy, group: dist.ProcessGroup | None = None):
        self.monitor = monitor
        self.policy = policy
        self.group = group
        self.update_applied = False

    def check(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None = None,
        fp8_health: Mapping[str, torch.Tensor] | None = None,
        shadow: tuple[torch.Tensor, torch.Tensor] | None = None,
        layer_health: Mapping[str, torch.Tensor] | None = None,
        gated_update: Callable[[torch.Tensor], bool] | None = None,
        stop: StopRequest | None = None,
    ) -> tuple[Decision, MonitorReport]:
        """gated_update, stop: see agree_and_decide; `self.update_applied` says whether it applied this step's
        update."""
        verdict_D = self.monitor.local_verdict(loss, grad_norm, fp8_health, shadow, layer_health)
        decision, report, self.update_applied = agree_and_decide(self.monitor, self.policy, verdict_D, step,
                                                                 self.group, gated_update, stop)
        return decision, report
