"""Stop requests that end a worker group with a checkpoint and no step lost: SIGTERM to a worker, the driver's
PREEMPT_FILE (PreemptNotice, catch_sigterm), and a node of the group leaving with notice.

A node's notice: a cloud's preemption notice handed to Ray as a drain with a deadline (`ray drain-node`, KubeRay's
preStop hook in deploy/kuberay, the autoscaler v2 before it terminates a node). Ray Train's preemption watcher tells
every worker of the group; the step's one agreement (the StopRequest slot, as for SIGTERM) makes it every rank's
decision at the same step; that step is saved; then the workers wait, training nothing, until the node is gone and
Ray Train restarts the group on the nodes that remain, from that checkpoint. No step is lost and none is trained
twice (docs/reliability.md). A node that goes without notice is a plain failure: the group restarts from the newest
checkpoint.

Why wait rather than go on training: until the node is gone Ray still counts its resources, so a group restarted at
once would ask for it again; and every step trained after the save would be trained again after the restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orchestration.divergence.agreement import StopRequest
from orchestration.observability.events import PREEMPT_FILE

# How long rank 0 waits for its own copy of a notice another rank has already acted on (the watcher tells every
# worker at once, through separate messages).
NOTICE_SPREAD_S = 10.0
# Ray Train's controller ends the group at the notice's deadline (or this long after a notice without one, its
# DEFAULT_PREEMPTION_DEADLINE_S); past that plus this margin something is wrong and the wait ends in an error.
NO_DEADLINE_S = 120.0
TEARDOWN_MARGIN_S = 120.0


def notice_info() -> Any | None:
    """The notice Ray Train's preemption watcher gave this worker (ray.train.PreemptionInfo), or None. A local read
    with no collective, cheap enough for every step; the public ray.train.get_preemption_info() is a barrier across
    the group, too costly per step. None outside a Ray Train worker."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except Exception:  # noqa: BLE001  # not in a Ray Train worker, or an older Ray without the watcher
        return None


def agreed_notice(rank: int, driver_asked_stop: bool, group: Any = None) -> dict[str, Any] | None:
    """After the agreed save-and-stop of a step: whether it was a node's notice (then the nodes, ranks and deadline
    that rank 0 saw, the same on every rank) or the driver's stop request (None). Collective: every rank calls it."""
    decided: dict[str, Any] | None = None
    if rank == 0 and not driver_asked_stop:
        deadline = time.time() + NOTICE_SPREAD_S
        info = notice_info()
        while info is None and time.time() < deadline:
            time.sleep(0.2)
            info = notice_info()
        if info is not None:
            decided = {"nodes": list(info.preempted_node_ids), "ranks": list(info.preempted_ranks),
                       "deadline": info.deadline_ms / 1000 if info.deadline_ms else None}
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(group) > 1:
        box = [decided]
        torch.distributed.broadcast_object_list(box, src=0, group=group)
        decided = box[0]
    return decided


def wait_for_the_node_to_go(notice: dict[str, Any], margin_s: float = TEARDOWN_MARGIN_S) -> None:
    """Block, training nothing, until Ray Train ends this worker group (it does at the notice's deadline, and the node
    is gone by then). Raises when that has not happened `margin_s` after the deadline: the group then restarts as
    after a failure."""
    until = (notice["deadline"] or time.time() + NO_DEADLINE_S) + margin_s
    while time.time() < until:
        time.sleep(0.5)
    raise RuntimeError(f"nodes {notice['nodes']} were announced to leave, but the worker group was not ended "
                       f"{margin_s:.0f} s after the notice's deadline")


def leave_if_a_node_goes(rank: int, driver_asked_stop: bool, checkpoints: Any, event: Any) -> None:
    """train_loop's hook after a loop that ended as "preempted" under Ray: returns when the stop was the driver's
    (SIGTERM: the run stops as before); for a node's notice, records a node_leaving event (`event`, the run
    observer's) once the checkpoint is written (`checkpoints.collect`) and waits for the group's end
    (wait_for_the_node_to_go), never returning."""
    notice = agreed_notice(rank, driver_asked_stop)
    if notice is None:
        return
    checkpoints.collect()
    event("node_leaving", **notice)
    wait_for_the_node_to_go(notice)


class PreemptNotice(StopRequest):
    """Save and stop at the next step boundary: SIGTERM to this worker (catch_sigterm sets sigterm_received) or, on
    rank 0, the driver's PREEMPT_FILE. Read by the step's agreement, as late as possible: one stat a step on rank 0
    for the driver's forwarded SIGTERM (any rank asking is enough)."""

    def __init__(self, run_dir: Path, rank: int, under_ray: bool):
        super().__init__()
        self.run_dir = run_dir
        self.preempt_file = run_dir / PREEMPT_FILE if rank == 0 else None
        self.under_ray = under_ray
        self.sigterm_received = False

    def asked(self) -> bool:
        # A node of the group leaving with notice (notice_info) asks too.
        return (self.sigterm_received or (self.preempt_file is not None and self.preempt_file.exists())
                or (self.under_ray and notice_info() is not None))

    def driver_asked(self) -> bool:
        """The stop is the driver's (SIGTERM or its PREEMPT_FILE), not a node's notice: read on every rank."""
        return self.sigterm_received or (self.run_dir / PREEMPT_FILE).exists()


def catch_sigterm(notice: PreemptNotice) -> Callable[[], None]:
    """SIGTERM (the notice Kubernetes, Slurm and spot reclaimers give; torchrun forwards its own to the workers) asks
    for a checkpoint at the next step boundary, then a stop: the handler only sets a flag, which the next step's
    agreement carries to every rank. A second SIGTERM ends the process at once. Handlers belong to the main thread:
    under Ray Train the loop runs in another one, and the driver forwards its SIGTERM through PREEMPT_FILE. Returns
    the function that puts the previous handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        if notice.sigterm_received:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        notice.sigterm_received = True

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, previous)
