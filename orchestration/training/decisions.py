"""What the worker loop does with the divergence guard's decision, beyond the step's own update (training/step.py):
write its events, switch precision, roll back in-process to the newest good checkpoint, or stop. The guard only
decides (divergence/guard.py); everything here changes the trainer's state, model, optimizer or checkpoints.
"""

from __future__ import annotations

from typing import Any

from orchestration.divergence.policy import Decision, FallbackToBF16, RetryFP8, Rollback, SkipStep, Stop
from orchestration.training.elastic import merge_ranges
from orchestration.training.optimizer import set_learning_rate


def apply_decision(trainer: Any, decision: Decision) -> str:
    """Apply an agreed decision (identical on every rank) to the worker loop's Trainer. Returns what the loop does
    next: 'proceed' | 'skip' | 'rolled_back' | 'stop'."""
    if decision.kind == "proceed":
        return "proceed"
    for record in decision.events():
        name = record.pop("event")
        record.pop("step", None)
        trainer.event(name, all_ranks=True, **record)
    if isinstance(decision, Stop):
        return "stop"
    if isinstance(decision, RetryFP8):
        set_precision(trainer, "fp8", decision.scope)
        return "proceed"
    if isinstance(decision, FallbackToBF16):
        set_precision(trainer, "bf16", decision.scope)
        return "skip"
    if isinstance(decision, SkipStep):
        trainer.event("step_skipped", all_ranks=True, reason=",".join(f.detector for f in decision.evidence))
        return "skip"
    if isinstance(decision, Rollback):
        if not trainer.job.checkpoint.every_steps:
            trainer.event("rollback_unavailable", all_ranks=True, bad_step=decision.bad_step,
                          reason="checkpoint.every_steps=0: no checkpoint to roll back to; the run stops")
            return "stop"
        rollback(trainer, decision)
        return "rolled_back"
    raise AssertionError(f"unhandled decision {decision!r}")


def apply_eval_gap_decision(trainer: Any, decision: Decision, eval_fp8: float, eval_bf16: float) -> None:
    """Apply the guard's decision on an evaluation's FP8-vs-BF16 gap (StepGuard.check_eval_gap), between steps: an
    eval_gap_exceeded event with both losses, the decision's events, and a fallback at once, so training goes on in
    BF16 from the next step."""
    if decision.kind == "proceed":
        return
    limit = trainer.guard.eval_gap_max
    gap = (eval_fp8 - eval_bf16) / abs(eval_bf16) if eval_bf16 else float("inf")
    trainer.event("eval_gap_exceeded", all_ranks=True, eval_loss_fp8=eval_fp8, eval_loss_bf16=eval_bf16,
                  rel_gap=gap, threshold=limit)
    for record in decision.events():
        name = record.pop("event")
        record.pop("step", None)
        trainer.event(name, all_ranks=True, **record)
    if isinstance(decision, FallbackToBF16):
        set_precision(trainer, "bf16", decision.scope)


def set_precision(trainer: Any, precision: str, scope: tuple[str, ...] | None) -> None:
    import fp8

    fp8.set_precision(trainer.model, precision, scope=list(scope) if scope else None)
    if scope is None:
        trainer.state.precision = precision


def apply_policy_precision(trainer: Any) -> None:
    """Put the model in the precision the guard's policy has in force: the run's mode, then the layers a layer-scoped
    fallback holds in bf16 (a whole-model switch alone would silently return them to FP8)."""
    if not trainer.guard.fp8_run:
        return
    precision, bf16_layers = trainer.guard.precision_in_force()
    set_precision(trainer, precision, None)
    if bf16_layers:
        set_precision(trainer, "bf16", bf16_layers)


def rollback(trainer: Any, decision: Rollback) -> None:
    """In-process: reload the newest good checkpoint (resharded if the world size changed), skip the data."""
    t, guard, checkpoints = trainer, trainer.guard, trainer.checkpoints
    # Every rank: finish the background save in flight first; if it passed its clean steps (or is the step-0 save)
    # it is marked good now and may be the newest good checkpoint.
    checkpoints.collect()
    # Collective, as at start: every rank must load the same step even if a shared filesystem shows one of them
    # an older manifest (only rank 0 writes the good marks).
    info = checkpoints.manager.latest(good_only=True, collective=True)
    if info is None:
        raise RuntimeError("rollback requested but no good checkpoint exists (the step-0 one was removed?)")
    bad_end = t.state.cursor + t.job.train.global_batch_size  # the bad step's samples are dropped too
    # The policy and the monitors' baselines are not rolled back: the policy bounds the episode.
    policy_state, monitor_state = guard.policy.state_dict(), guard.monitor.state_dict()
    extra = checkpoints.manager.load(info, t.model, t.optimizer, t.scheduler)
    checkpoints.restore_extra(extra)
    guard.policy.load_state_dict(policy_state)
    guard.monitor.load_state_dict(monitor_state)
    guard.policy.on_rollback(t.state.step)
    new_cursor = bad_end + decision.skip_samples_window
    skipped = [t.state.cursor, new_cursor]
    t.state.skipped_ranges = merge_ranges(t.state.skipped_ranges + [skipped])
    t.state.cursor = new_cursor
    t.state.lr_scale = decision.lr_scale
    set_learning_rate(t.optimizer, t.job, t.state.step, t.state.lr_scale)  # restore_extra set the checkpoint's scale
    # The precision in force is the policy's, not the checkpoint's (a fallback stays in effect after it).
    apply_policy_precision(t)
    t.optimizer.zero_grad(set_to_none=True)
    if t.rank == 0:
        checkpoints.manager.discard_newer_than(t.state.step)  # a restart must not resume into the diverged trajectory
    checkpoints.manager.awaiting_good = {s for s in checkpoints.manager.awaiting_good if s <= t.state.step}
    t.event("rollback", all_ranks=True, to_step=t.state.step, from_step=decision.bad_step,
            skipped_samples=skipped[1] - skipped[0], skipped_range=skipped, checkpoint=str(info.path),
            lr_scale=decision.lr_scale)
    # Re-save the step with what the rollback decided (data cursor past the bad samples, skipped ranges, lr scale,
    # the policy's counters and precision): a restart before the next periodic save would otherwise resume the
    # checkpoint as it was, replay the skipped samples and forget the rollback (max_rollbacks unbounded). The
    # model, optimizer, scheduler and RNG are the checkpoint's own: only the extra state is written.
    checkpoints.resave_after_rollback(info)
