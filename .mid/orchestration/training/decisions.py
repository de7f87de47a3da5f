"""What the worker loop does with the divergence guard's decision, beyond the step's own update (training/step.py):
write its events, switch precision, roll back in-process to the newest good checkpoint, or stop. The guard only
decides (divergence/guard.py); everything here changes the training state or the checkpoints.
"""

from __future__ import annotations

from orchestration.config import JobConfig
from orchestration.divergence.guard import StepGuard
from orchestration.divergence.policy import Decision, FallbackToBF16, RetryFP8, Rollback, SkipStep, Stop
from orchestration.training.checkpointing import RunCheckpoints
from orchestration.training.observer import RunObserver
from orchestration.training.optimizer import set_learning_rate
from orchestration.training.state import TrainingState


def apply_decision(decision: Decision, state: TrainingState, guard: StepGuard, checkpoints: RunCheckpoints,
                   observer: RunObserver, job: JobConfig) -> str:
    """Apply an agreed decision (identical on every rank). Returns what the loop does next:
    'proceed' | 'skip' | 'rolled_back' | 'stop'."""
    if decision.kind == "proceed":
        return "proceed"
    write_decision_events(decision, observer)
    if isinstance(decision, Stop):
        return "stop"
    if isinstance(decision, RetryFP8):
        state.set_precision("fp8", decision.scope)
        return "proceed"
    if isinstance(decision, FallbackToBF16):
        state.set_precision("bf16", decision.scope)
        return "skip"
    if isinstance(decision, SkipStep):
        observer.event("step_skipped", all_ranks=True, reason=",".join(f.detector for f in decision.evidence))
        return "skip"
    if isinstance(decision, Rollback):
        if not job.checkpoint.every_steps:
            observer.event("rollback_unavailable", all_ranks=True, bad_step=decision.bad_step,
                           reason="checkpoint.every_steps=0: no checkpoint to roll back to; the run stops")
            return "stop"
        rollback(decision, state, guard, checkpoints, observer, job)
        return "rolled_back"
    raise AssertionError(f"unhandled decision {decision!r}")


def apply_eval_gap_decision(decision: Decision, state: TrainingState, guard: StepGuard, observer: RunObserver,
                            eval_fp8: float, eval_bf16: float) -> None:
    """Apply the guard's decision on an evaluation's FP8-vs-BF16 gap (StepGuard.check_eval_gap), between steps: an
    eval_gap_exceeded event with both losses, the decision's events, and a fallback at once, so training goes on in
    BF16 from the next step."""
    if decision.kind == "proceed":
        return
    gap = (eval_fp8 - eval_bf16) / abs(eval_bf16) if eval_bf16 else float("inf")
    observer.event("eval_gap_exceeded", all_ranks=True, eval_loss_fp8=eval_fp8, eval_loss_bf16=eval_bf16,
                   rel_gap=gap, threshold=guard.eval_gap_max)
    write_decision_events(decision, observer)
    if isinstance(decision, FallbackToBF16):
        state.set_precision("bf16", decision.scope)


def write_decision_events(decision: Decision, observer: RunObserver) -> None:
    """The decision's own events (divergence_detected, policy_decision, precision_changed, ...), on every rank."""
    for record in decision.events():
        name = record.pop("event")
        record.pop("step", None)
        observer.event(name, all_ranks=True, **record)


def rollback(decision: Rollback, state: TrainingState, guard: StepGuard, checkpoints: RunCheckpoints,
             observer: RunObserver, job: JobConfig) -> None:
    """In-process: reload the newest good checkpoint (resharded if the world size changed), skip the data."""
    # Every rank: finish the background save in flight first; if it passed its clean steps (or is the step-0 save)
    # it is marked good now and may be the newest good checkpoint.
    checkpoints.collect()
    # Collective, as at start: every rank must load the same step even if a shared filesystem shows one of them
    # an older manifest (only rank 0 writes the good marks).
    info = checkpoints.manager.latest(good_only=True, collective=True)
    if info is None:
        raise RuntimeError("rollback requested but no good checkpoint exists (the step-0 one was removed?)")
    bad_end = state.cursor + job.train.global_batch_size  # the bad step's samples are dropped too
    # The policy and the monitors' baselines are not rolled back: the policy bounds the episode.
    policy_state, monitor_state = guard.policy.state_dict(), guard.monitor.state_dict()
    checkpoints.load(info)
    guard.policy.load_state_dict(policy_state)
    guard.monitor.load_state_dict(monitor_state)
    guard.policy.on_rollback(state.step)
    skipped = state.skip_to(bad_end + decision.skip_samples_window)
    state.lr_scale = decision.lr_scale
    set_learning_rate(state.optimizer, job, state.step, state.lr_scale)  # the load set the checkpoint's scale
    # The precision in force is the policy's, not the checkpoint's (a fallback stays in effect after it).
    state.follow_policy_precision(guard)
    state.optimizer.zero_grad(set_to_none=True)
    checkpoints.discard_newer_than_current()  # a restart must not resume into the diverged trajectory
    observer.event("rollback", all_ranks=True, to_step=state.step, from_step=decision.bad_step,
                   skipped_samples=skipped[1] - skipped[0], skipped_range=skipped, checkpoint=str(info.path),
                   lr_scale=decision.lr_scale)
    # Re-save the step with what the rollback decided (data cursor past the bad samples, skipped ranges, lr scale,
    # the policy's counters and precision): a restart before the next periodic save would otherwise resume the
    # checkpoint as it was, replay the skipped samples and forget the rollback (max_rollbacks unbounded). The
    # model, optimizer, scheduler and RNG are the checkpoint's own: only the extra state is written.
    checkpoints.resave_after_rollback(info)
