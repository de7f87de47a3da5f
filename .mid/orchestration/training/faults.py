"""Fault injection from config (conf/faults): corrupt the loss, the gradients or an activation, or end the process,
at a given step on a given rank. Used by tests and demos; never by code edits (docs/reliability.md).

The worker attaches the configured fault once, from outside the step (FaultInjector.attach: forward hooks on the
model's FP8 layers, loss and gradient hooks on the StepModel), and calls maybe_crash at the top of every step. The
`maybe_*` methods do nothing unless the plan says this (step, rank) is hit:

    plan = FaultPlan(FaultConfig(kind="loss_spike", rank=1, step=30))
    plan.maybe_crash(step, rank)                       # top of the step: kill_worker / crash
    loss = plan.maybe_inject_loss(loss, step, rank)     # before backward: loss_spike (scales the grads too)
    plan.maybe_inject_grads(model, step, rank)          # after backward, before the grad norm: nan_grad
    handle = plan.attach_activation_fault(layer, rank, lambda: current_step)   # once: fp8_overflow

Each hit step fires once: a step replayed after a rollback is not hit again (the data that "caused" the fault
was skipped, as in the real thing). Markers in `marker_dir` make that survive a process restart, which is what
kill_worker/crash need: Ray Train restarts the worker, which replays the step that killed it; the marker, written
and fsynced before the process dies, keeps the fault from firing forever.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from orchestration.config import PROCESS_FAULTS, FaultConfig

if TYPE_CHECKING:
    from orchestration.training.step import StepModel


class InjectedCrash(RuntimeError):
    """Raised by the `crash` fault."""


class FaultPlan:
    """The configured fault, and which of its steps already fired (in memory and, with marker_dir, on disk)."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.config = config or FaultConfig()
        self.config.validate()
        if self.config.kind in PROCESS_FAULTS and not self.config.marker_dir:
            raise ValueError(f"faults.kind={self.config.kind} needs faults.marker_dir (an absolute directory, e.g. "
                             "under the run directory): the restarted worker must see that the fault already fired")
        self._done: set[int] = set()
        self._firing_step: int | None = None

    # ------------------------------------------------------------------------------------------- bookkeeping
    def marker_path(self, step: int, rank: int) -> Path | None:
        if not self.config.marker_dir:
            return None
        return Path(self.config.marker_dir) / f"fault_{self.config.kind}_rank{rank}_step{step}.fired"

    def _hits(self, kind: str | tuple[str, ...], step: int, rank: int) -> bool:
        cfg = self.config
        kinds = (kind,) if isinstance(kind, str) else kind
        if cfg.kind not in kinds or (cfg.rank != -1 and cfg.rank != rank):
            return False
        last = cfg.step if cfg.kind in PROCESS_FAULTS else cfg.step + cfg.num_steps - 1
        return cfg.step <= step <= last

    def _fire(self, kind: str, step: int, rank: int) -> bool:
        """True if the fault fires now. A step fires on every call while it is the current step (micro-batches,
        several hooked forwards) and never again once another step was seen (replay after a rollback)."""
        self._advance(step)
        if not self._hits(kind, step, rank) or step in self._done:
            return False
        if self._firing_step == step:
            return True
        marker = self.marker_path(step, rank)
        if marker is not None:
            if marker.exists():
                self._done.add(step)
                return False
            _write_marker(marker, f"{self.config.kind} rank={rank} step={step} pid={os.getpid()}\n")
        self._firing_step = step
        return True

    def _advance(self, step: int) -> None:
        # Seeing a step other than the one firing means that step is over: it must not fire when replayed.
        if self._firing_step is not None and step != self._firing_step:
            self._done.add(self._firing_step)
            self._firing_step = None

    def fired(self, step: int, rank: int) -> bool:
        """Whether the fault already fired at (step, rank), in this process or (with markers) an earlier one."""
        marker = self.marker_path(step, rank)
        return step in self._done or step == self._firing_step or (marker is not None and marker.exists())

    # ---------------------------------------------------------------------------------------- tensor faults
    def maybe_inject_loss(self, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        """loss_spike: the loss times `magnitude` (differentiable, so the gradients spike as well)."""
        if not self._fire("loss_spike", step, rank):
            return loss
        return loss * self.config.effective_magnitude

    def maybe_inject_grads(self, model: nn.Module | Iterable[nn.Parameter], step: int, rank: int) -> bool:
        """nan_grad: set the first element of the first non-empty local gradient to NaN. True if injected.

        Call after backward (and after FSDP's reduce-scatter), before the grad norm. DTensor gradients are
        corrupted in this rank's local shard, as a bad device would.
        """
        self._advance(step)
        if not self._hits("nan_grad", step, rank):
            return False
        params = model.parameters() if isinstance(model, nn.Module) else model
        for p in params:
            if p.grad is None:
                continue
            with torch.no_grad():
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if grad.numel() == 0:
                    continue
                if not self._fire("nan_grad", step, rank):
                    return False
                grad.view(-1)[0] = float("nan")
                return True
        return False

    def maybe_inject_activation(self, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        """fp8_overflow: x with its first element replaced by magnitude * amax(x) (out of place, no host sync)."""
        if not self._fire("fp8_overflow", step, rank):
            return x
        flat = x.reshape(-1)
        amax = flat.detach().abs().max().float()
        outlier = torch.where(amax > 0, amax, torch.ones_like(amax)) * self.config.effective_magnitude
        index = torch.zeros(1, dtype=torch.long, device=x.device)
        return flat.index_fill(0, index, outlier.to(x.dtype)).view_as(x)

    def attach_activation_fault(self, module: nn.Module, rank: int, get_step: Callable[[], int]):
        """Forward pre-hook on `module` (e.g. an FP8 linear) that runs maybe_inject_activation on its first input.
        Returns the hook handle (call .remove() to detach). Attach only for kind fp8_overflow."""

        def pre_hook(_module: nn.Module, args: tuple):
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            return (self.maybe_inject_activation(args[0], get_step(), rank),) + tuple(args[1:])

        return module.register_forward_pre_hook(pre_hook)

    def maybe_scale_fp8_output(self, module: nn.Module, y: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        """fp8_scale_error: while `module` computes in FP8 (fp8_enabled) at a hit step, each output column of y times
        exp(magnitude * z), z ~ N(0, 1) drawn from a generator seeded with the step: a wrong dequantization scale per
        channel, the same in every forward of a step, another one at the next step (so training cannot learn it
        away, as it did a constant x0.5: the FP8 eval then came out better than BF16's)."""
        if not (getattr(module, "fp8_enabled", False) and self._hits("fp8_scale_error", step, rank)):
            return y
        generator = torch.Generator().manual_seed(step)
        z = torch.randn(y.shape[-1], generator=generator)
        return y * torch.exp(z * self.config.effective_magnitude).to(device=y.device, dtype=y.dtype)

    def attach_fp8_scale_fault(self, module: nn.Module, rank: int, get_step: Callable[[], int]):
        """Forward hook on an FP8 linear that runs maybe_scale_fp8_output on its output, in every forward of a hit
        step (training and evaluation). Returns the hook handle. Attach only for kind fp8_scale_error."""

        def hook(mod: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
            return self.maybe_scale_fp8_output(mod, output, get_step(), rank)

        return module.register_forward_hook(hook)

    # --------------------------------------------------------------------------------------- process faults
    def maybe_crash(self, step: int, rank: int, before: Callable[[], Any] | None = None) -> None:
        """kill_worker: SIGKILL this process; crash: raise InjectedCrash. Once per (rank, step), across restarts.
        `before` runs just before either (the worker finishes a background checkpoint write there)."""
        if self._hits(PROCESS_FAULTS, step, rank) and self._fire(self.config.kind, step, rank):
            if before is not None:
                before()
            if self.config.kind == "kill_worker":
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedCrash(f"injected crash at step {step} on rank {rank} (faults.kind=crash)")


class FaultInjector(FaultPlan):
    """FaultPlan bound to one rank, with the marker directory supplied by the worker (e.g. <run_dir>/faults) when
    the config leaves it empty. The `rank` arguments default to the bound rank."""

    def __init__(self, config: FaultConfig | None, rank: int, marker_dir: str | os.PathLike | None = None) -> None:
        config = config or FaultConfig()
        if marker_dir is not None and not config.marker_dir:
            config = replace(config, marker_dir=str(Path(marker_dir).resolve()))
        super().__init__(config)
        self.rank = rank

    def attach(self, sm: StepModel, get_step: Callable[[], int]) -> None:
        """Wire the configured fault into the step from outside: loss_spike and nan_grad as the StepModel's loss and
        gradient hooks, fp8_overflow and fp8_scale_error as forward hooks on the model's FP8 layers. `get_step`
        gives the step being run."""
        from fp8.linear import Float8Linear

        kind = self.config.kind
        if kind == "loss_spike":
            sm.loss_hooks.append(lambda loss: self.maybe_corrupt_loss(loss, get_step()))
        elif kind == "nan_grad":
            sm.grad_hooks.append(lambda model: self.maybe_corrupt_grads(model, get_step()))
        elif kind == "fp8_overflow":
            # Real numerics: an outlier enters the first FP8 layer, so the FP8 health statistics see it.
            target = next((m for m in sm.model.modules() if isinstance(m, Float8Linear)), None)
            if target is None:
                raise ValueError("faults=fp8_overflow needs an FP8 model: use precision=fp8")
            self.attach_activation_fault(target, self.rank, get_step)
        elif kind == "fp8_scale_error":
            # The blocks' FP8 linears (not the output head, whose fused form returns the loss itself).
            targets = [m for name, m in sm.model.named_modules()
                       if isinstance(m, Float8Linear) and name.startswith("layers.")]
            if not targets:
                raise ValueError("faults=fp8_scale_error needs an FP8 model: use precision=fp8")
            for target in targets:
                self.attach_fp8_scale_fault(target, self.rank, get_step)

    def _r(self, rank: int | None) -> int:
        return self.rank if rank is None else rank

    def maybe_corrupt_loss(self, loss: torch.Tensor, step: int, rank: int | None = None) -> torch.Tensor:
        return self.maybe_inject_loss(loss, step, self._r(rank))

    def maybe_corrupt_grads(self, model: nn.Module | Iterable[nn.Parameter], step: int,
                            rank: int | None = None) -> bool:
        return self.maybe_inject_grads(model, step, self._r(rank))

    def maybe_corrupt_activation(self, x: torch.Tensor, step: int, rank: int | None = None) -> torch.Tensor:
        return self.maybe_inject_activation(x, step, self._r(rank))

    def maybe_crash(self, step: int, rank: int | None = None, before: Callable[[], Any] | None = None) -> None:
        super().maybe_crash(step, self._r(rank), before)

    def maybe_corrupt_fp8_health(self, health: Mapping[str, torch.Tensor] | None, step: int,
                                 rank: int | None = None) -> dict[str, torch.Tensor] | None:
        """fp8_overflow without touching the model: the health statistics an overflow would produce (every
        sampled value clamped to the FP8 max, amax grown `magnitude` times). A simulated detector input; the
        activation hook (attach_activation_fault) is the real-numerics variant."""
        if health is None or not self._fire("fp8_overflow", step, self._r(rank)):
            return None if health is None else dict(health)
        out = dict(health)
        if "saturated_frac" in out:
            out["saturated_frac"] = torch.ones_like(out["saturated_frac"])
        if "amax_max" in out:
            amax = out["amax_max"]
            out["amax_max"] = torch.where(amax > 0, amax, torch.ones_like(amax)) * self.config.effective_magnitude
        return out


def _write_marker(path: Path, text: str) -> None:
    # Written atomically and fsynced: the process may be killed right after, and a torn or missing marker would
    # make the restarted worker fire the fault again.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
