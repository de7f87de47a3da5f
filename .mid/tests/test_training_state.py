"""The worker's TrainingState on its own (no process group, no data): the progress a step and a rollback record, its
round trip through a checkpoint's "train_state", and the one signal that the weights changed outside the optimizer."""

import torch
from torch import nn

import fp8
from orchestration.config import MonitorConfig
from orchestration.divergence.guard import StepGuard
from orchestration.training.state import PROGRESS_FIELDS, TrainingState
from orchestration.training.step import StepModel


class TwoBlocks(nn.Module):
    """What fp8_watch_units reads: blocks under `layers`, each with one linear of FP8-friendly sizes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(32, 32), "1": nn.Linear(32, 32)})


def make_state(convert: bool = True) -> TrainingState:
    model = TwoBlocks()
    if convert:
        fp8.convert_to_fp8(model, "tensorwise")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return TrainingState(StepModel(model, optimizer, torch.device("cpu")), scheduler, "tensorwise" if convert else None)


def test_steps_and_a_rollback_window_record_which_samples_trained():
    state = make_state(convert=False)
    state.advance(8, updated=True)
    state.advance(8, updated=False)  # a skipped step: its samples are dropped, the cursor moves on
    state.advance(8, updated=True)
    assert (state.step, state.cursor) == (3, 24)
    assert state.consumed_ranges == [[0, 8], [16, 24]] and state.skipped_ranges == [[8, 16]]
    assert state.skip_to(40) == [24, 40]
    assert state.cursor == 40 and state.skipped_ranges == [[8, 16], [24, 40]]


def test_progress_round_trips_and_an_older_checkpoint_takes_the_defaults():
    state = make_state(convert=False)
    state.advance(4, updated=True)
    state.lr_scale, state.precision = 0.5, "bf16"
    saved = state.progress()
    assert tuple(saved) == PROGRESS_FIELDS
    other = make_state(convert=False)
    other.load_progress(saved)
    assert other.progress() == saved
    other.load_progress({"step": 7, "cursor": 28})  # no ranges, precision or scale recorded
    assert other.progress() == {"step": 7, "cursor": 28, "consumed_ranges": [], "skipped_ranges": [],
                                "precision": "fp8", "lr_scale": 1.0}


def test_every_precision_switch_is_signalled_once_with_what_changed():
    state = make_state()
    seen = []
    state.weights_listeners.append(seen.append)
    state.set_precision("bf16", ("layers.1",))
    assert state.precision == "fp8"  # a layer-scoped switch leaves the whole model's precision in force
    assert fp8.precision_state(state.model)["modules"] == {"layers.0": "fp8", "layers.1": "bf16"}
    state.set_precision("bf16")
    assert state.precision == "bf16"
    guard = StepGuard(MonitorConfig(fallback_scope="layers"), state.model, fp8_run=True)
    guard.policy.s.bf16_scope = ["layers.0"]  # the policy's state after a layer-scoped fallback of block 0
    state.follow_policy_precision(guard)
    assert state.precision == "fp8"
    assert fp8.precision_state(state.model)["modules"] == {"layers.0": "bf16", "layers.1": "fp8"}
    assert seen == ["precision bf16 for layers.1", "precision bf16", "precision fp8, bf16 for layers.0"]
