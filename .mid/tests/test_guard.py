"""The worker loop's guard in one process (world size 1, no Ray): layer-scoped BF16 fallback and the shadow check
reach fp8.set_precision for exactly the blocks the evidence names."""

import pytest
from hydra import compose, initialize_config_dir

from orchestration.config import to_dict
from orchestration.observability.events import read_jsonl
from orchestration.training.loop import Trainer
from orchestration.validation import load_job_config
from tests.conftest import REPO
from tests.interp_child import expose_or_run


def make_trainer(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=debug_dense", "precision=fp8", "cluster.min_workers=1", "cluster.max_workers=1",
            "logging.wandb=false", "logging.ray_metrics=false", "train.global_batch_size=4",
            "train.micro_batch_size=4", "data.seq_len=32", "train.log_every=1", "train.warmup_steps=1", *overrides])
    job = load_job_config(cfg)
    return Trainer({"job": to_dict(job), "run_dir": str(tmp_path / "run")})


def train_to_end(trainer) -> str:
    """Start, train and finish the run as train_loop does; its status."""
    trainer.start()
    status = trainer.run()
    trainer.finish(status)
    return status


def record_shadow_checks(trainer) -> dict[int, tuple[float, float]]:
    """{step: (fp8 loss, bf16 loss)} of every shadow check the trainer's guard runs from now on."""
    shadows = {}
    check = trainer.guard.check

    def recorded(step, loss, grad_norm, fp8_health, shadow, *args, **kwargs):
        if shadow is not None:
            shadows[trainer.state.step] = tuple(v.item() for v in shadow)
        return check(step, loss, grad_norm, fp8_health, shadow, *args, **kwargs)

    trainer.guard.check = recorded
    return shadows


def test_saturation_in_one_block_falls_back_only_that_block(tmp_path):
    trainer = make_trainer(tmp_path, "train.steps=4", "monitor.fallback_scope=layers")
    import fp8

    target = trainer.state.model.get_submodule("layers.1.feed_forward.w1")

    def saturate_from_step_2(module, args, output):
        # Synthetic evidence: this layer reports every sampled value at the FP8 max (what a stale scale gives).
        if trainer.state.step >= 2:
            module.fp8_health_stats[0] = 1.0
        return output

    target.register_forward_hook(saturate_from_step_2)
    trainer.start()
    status = trainer.run()
    assert status == "completed"
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    detected = [e for e in events if e["event"] == "divergence_detected"]
    assert {e["step"] for e in detected} == {2}
    assert "fp8_layer:layers.1" in {e["detector"] for e in detected}
    assert not [e for e in detected if e["detector"].startswith("fp8_layer:") and e["detector"] != "fp8_layer:layers.1"]
    change = next(e for e in events if e["event"] == "precision_changed")
    assert change["scope"] == ["layers.1"] and change["to"] == "bf16"
    modules = fp8.precision_state(trainer.state.model)["modules"]
    assert all(v == "bf16" for k, v in modules.items() if k.startswith("layers.1."))
    assert all(v == "fp8" for k, v in modules.items() if not k.startswith("layers.1."))
    # The bad step never updated the weights; the other steps did.
    assert [e["step"] for e in events if e["event"] == "policy_decision"] == [2]
    # The decision is reflected in metrics.jsonl from that step on.
    metrics = {m["step"]: m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert metrics[2]["policy_fallbacks"] == 0 and metrics[3]["policy_fallbacks"] == 1


def test_shadow_check_compares_fp8_and_bf16_losses_without_false_alarm(tmp_path):
    trainer = make_trainer(tmp_path, "train.steps=4", "monitor.shadow_every=2")
    shadows = record_shadow_checks(trainer)
    trainer.start()
    assert trainer.run() == "completed"
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert not [e for e in events if e["event"] == "divergence_detected"]
    # The shadow check ran at steps 0 and 2 only, on two different computations (fp8 and bf16 differ, but by less
    # than the alarm's relative tolerance), and left the model in FP8.
    assert sorted(shadows) == [0, 2]
    for loss_fp8, loss_bf16 in shadows.values():
        assert 0 < abs(loss_fp8 - loss_bf16) / loss_bf16 < trainer.ctx.job.monitor.shadow_rel_tol
    import fp8

    assert set(fp8.precision_state(trainer.state.model)["modules"].values()) == {"fp8"}


def test_resuming_a_run_of_another_model_is_refused_and_loses_nothing(tmp_path):
    import pytest

    first = make_trainer(tmp_path, "train.steps=2")
    first.start()
    assert first.run() == "completed"
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    other = make_trainer(tmp_path, "train.steps=2", "model=debug_moe")
    with pytest.raises(ValueError, match="choose a new run_name"):
        other.start()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == checkpoints
    # Another data seed maps every sample index to another window: refused by the worker too (torchrun and
    # in-process starts do not always pass the driver's check).
    reseeded = make_trainer(tmp_path, "train.steps=3", "data.seed=7")
    with pytest.raises(ValueError, match=r"data settings \{'seed': 1234, 'seq_len': 32, 'window_rule': 2\}, now \{'seed': 7"):
        reseeded.start()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == checkpoints


def _saturate_from_step_2(trainer, module_name):
    def hook(module, args, output):
        # Synthetic evidence: every sampled value at the FP8 max (what a stale scale gives).
        if trainer.state.step >= 2:
            module.fp8_health_stats[0] = 1.0
        return output

    trainer.state.model.get_submodule(module_name).register_forward_hook(hook)


def test_saturation_in_the_fp8_head_falls_back_only_the_head(tmp_path):
    """With precision.fp8_output_head the head has its own slot: in the model-wide mean a saturating head would
    stay under the alarm, and a block's fallback would leave the head in FP8."""
    import fp8

    trainer = make_trainer(tmp_path, "train.steps=4", "monitor.fallback_scope=layers", "precision.fp8_output_head=true")
    assert trainer.guard.layer_names[-1] == "output"
    _saturate_from_step_2(trainer, "output")
    trainer.start()
    assert trainer.run() == "completed"
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    layer_detectors = {e["detector"] for e in events
                       if e["event"] == "divergence_detected" and e["detector"].startswith("fp8_layer:")}
    assert layer_detectors == {"fp8_layer:output"}
    change = next(e for e in events if e["event"] == "precision_changed")
    assert change["scope"] == ["output"] and change["to"] == "bf16"
    modules = fp8.precision_state(trainer.state.model)["modules"]
    assert modules["output"] == "bf16"
    assert all(v == "fp8" for k, v in modules.items() if k != "output")


def test_layer_fallback_survives_the_shadow_check_and_a_resume(tmp_path):
    """The shadow check and a resume put the model back in the policy's precision: the whole-model switch must not
    return the layers a layer-scoped fallback holds in bf16 to FP8."""
    import fp8

    def bf16_modules(trainer):
        return {k for k, v in fp8.precision_state(trainer.state.model)["modules"].items() if v == "bf16"}

    first = make_trainer(tmp_path, "train.steps=4", "monitor.fallback_scope=layers", "monitor.shadow_every=1")
    _saturate_from_step_2(first, "layers.1.feed_forward.w1")
    shadows = record_shadow_checks(first)
    first.start()
    assert first.run() == "completed"
    assert 3 in shadows  # a shadow check ran after the fallback (step 2)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["scope"] for e in events if e["event"] == "precision_changed"] == [["layers.1"]]
    held = bf16_modules(first)
    assert held and all(k.startswith("layers.1.") for k in held)  # after step 3's shadow check too
    assert first.guard.policy.bf16_layers == ("layers.1",)

    resumed = make_trainer(tmp_path, "train.steps=5", "monitor.fallback_scope=layers", "monitor.shadow_every=1")
    resumed.start()
    assert resumed.state.step == 4
    assert bf16_modules(resumed) == held
    assert resumed.run() == "completed"
    assert bf16_modules(resumed) == held  # step 4's shadow check ran in the resumed run


@pytest.mark.parametrize("async_save", ["never", "always"])
def test_rollback_resaves_its_step_with_what_it_decided(tmp_path, async_save):
    """A rollback re-saves the step it went back to with the new data cursor, skipped window, precision and
    rollback count: a restart before the next periodic save resumes past the bad samples with the rollback
    counted (max_rollbacks stays a bound), instead of the checkpoint's state as it was before the rollback.
    With background saves the same: the rollback first finishes the step-30 save in flight, then discards it."""
    import json

    batch = 8
    trainer = make_trainer(tmp_path, "train.steps=34", f"train.global_batch_size={batch}",
                           f"train.micro_batch_size={batch}", "checkpoint.every_steps=10",
                           "monitor.good_after_steps=5", "faults=loss_spike", "faults.rank=0", "faults.step=30",
                           "faults.num_steps=3", f"checkpoint.async_save={async_save}")
    status = train_to_end(trainer)
    assert status == "completed"
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    background = [e["checkpoint_step"] for e in events if e["event"] == "checkpoint_timing" and e.get("background")]
    # step 0 (good by definition, marked once written) and 30 before and after the rollback
    assert background == ([0, 10, 20, 30, 30] if async_save == "always" else [])
    discarded = [e["step"] for e in events if e["event"] == "checkpoint_deleted" and "rollback" in e["reason"]]
    assert discarded == [30]  # the diverged trajectory's save, finished first when it was in flight
    rollback = next(e for e in events if e["event"] == "rollback")
    assert (rollback["to_step"], rollback["from_step"]) == (20, 32)
    resaved = [e for e in events if e["event"] == "checkpoint_saved" and e["step"] == 20]
    assert len(resaved) == 2 and resaved[1]["time"] >= rollback["time"]
    extra = json.loads((tmp_path / "run" / "checkpoints" / "step_000020" / "extra_state.json").read_text())
    assert extra["train_state"]["step"] == 20
    assert extra["train_state"]["cursor"] == 33 * batch  # past the bad step's samples
    assert extra["train_state"]["skipped_ranges"] == [[20 * batch, 33 * batch]]
    assert extra["train_state"]["precision"] == "bf16"  # the fallback before the rollback stays in force
    assert extra["guard"]["policy"]["rollbacks"] == 1
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_000020" / "manifest.json").read_text())
    assert manifest["good"] is True


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_restart_right_after_a_rollback_trains_as_the_run_that_went_on(tmp_path, monkeypatch, hard_links):
    """The rollback's re-save links the loaded checkpoint's tensor, scheduler and RNG files and writes only the new
    extra state: a run that dies right after it resumes past the skipped samples, with the fallback, the rollback and
    its learning-rate scale in force, and trains steps 21-34 to the same losses as the run that went on in process
    (which trained its first step after the rollback at the checkpoint's scale before the scale was set again).
    Where the filesystem has no hard links, the step is written in full, with the same outcome."""
    import errno
    import json

    from orchestration.checkpoint import writer
    from orchestration.training.checkpointing import RunCheckpoints

    if not hard_links:
        def no_links(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted", str(dst))

        monkeypatch.setattr(writer.os, "link", no_links)

    spike = ("train.steps=34", "train.global_batch_size=8", "train.micro_batch_size=8", "checkpoint.every_steps=10",
             "monitor.good_after_steps=5", "faults=loss_spike", "faults.rank=0", "faults.step=30",
             "faults.num_steps=3", "checkpoint.async_save=never", "monitor.rollback_lr_scale=0.5")
    went_on = make_trainer(tmp_path / "went_on", *spike)
    assert train_to_end(went_on) == "completed"

    class DiedAfterTheRollback(Exception):
        pass

    resave = RunCheckpoints.resave_after_rollback

    def resave_then_die(self, info):
        resave(self, info)
        raise DiedAfterTheRollback

    monkeypatch.setattr(RunCheckpoints, "resave_after_rollback", resave_then_die)
    died = make_trainer(tmp_path / "restarted", *spike)
    with pytest.raises(DiedAfterTheRollback):
        train_to_end(died)
    monkeypatch.setattr(RunCheckpoints, "resave_after_rollback", resave)
    restarted = make_trainer(tmp_path / "restarted", *spike)
    restarted.start()
    assert restarted.state.step == 20 and restarted.state.cursor == 33 * 8
    assert restarted.state.precision == "bf16" and restarted.guard.policy.s.rollbacks == 1
    assert restarted.run() == "completed"

    def last_losses(run):
        metrics = {m["step"]: m["loss"] for m in read_jsonl(tmp_path / run / "run" / "metrics.jsonl")}
        return [metrics[step] for step in range(21, 35)]

    assert last_losses("restarted") == pytest.approx(last_losses("went_on"), rel=1e-6, abs=0)
    events = read_jsonl(tmp_path / "restarted" / "run" / "events.jsonl")
    rollback = next(e for e in events if e["event"] == "rollback")
    timings = [e for e in events if e["event"] == "checkpoint_timing" and e["time"] >= rollback["time"]]
    manifest = json.loads((tmp_path / "restarted" / "run" / "checkpoints" / "step_000020" / "manifest.json").read_text())
    assert len(manifest["files"]) >= 6 and manifest["good"] is True
    if hard_links:  # every file of the step-20 checkpoint but its extra state linked, none written again
        assert timings[0]["linked_files"] == len(manifest["files"]) - 1 and "write_s" not in timings[0]
    else:
        assert "Operation not permitted" in timings[0]["no_hard_links"] and timings[1]["write_s"] > 0


def test_a_save_still_being_written_when_it_passed_its_clean_steps_is_the_rollback_target(tmp_path, monkeypatch):
    """good_after_steps counts clean steps after a save, not after its write: the step-30 save, still being written
    in the background when the spike at 34-36 comes (its write is held 2 s here; 13 GB took 11 s on an H100 while
    steps took 0.07 s), passed its 2 clean steps (31, 32) first, so the rollback goes back to 30, not to 20."""
    import time

    from orchestration.checkpoint import manager as manager_module

    original = manager_module.write_and_finalize

    def slow_write(job, **kwargs):
        if job.step == 30:
            time.sleep(2.0)
        return original(job, **kwargs)

    monkeypatch.setattr(manager_module, "write_and_finalize", slow_write)
    trainer = make_trainer(tmp_path, "train.steps=40", "train.global_batch_size=8", "train.micro_batch_size=8",
                           "checkpoint.every_steps=10", "checkpoint.async_save=always", "monitor.good_after_steps=2",
                           "faults=loss_spike", "faults.rank=0", "faults.step=34", "faults.num_steps=3")
    status = train_to_end(trainer)
    assert status == "completed"
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    rollback = next(e for e in events if e["event"] == "rollback")
    assert (rollback["to_step"], rollback["from_step"]) == (30, 36)
    # marked good when its write finished, before the rollback used it; again by the rollback's re-save
    marks = [e["time"] for e in events if e["event"] == "checkpoint_good" and e["step"] == 30]
    assert len(marks) == 2 and marks[0] <= rollback["time"] <= marks[1]


def test_without_checkpoints_nothing_is_saved_and_a_needed_rollback_stops_the_run(tmp_path):
    """checkpoint.every_steps=0: no step-0, periodic or final save; the same loss spike that rolls back above
    (fallback, then rollback on the relapse) stops the run with a rollback_unavailable event instead."""
    clean = make_trainer(tmp_path / "clean", "train.steps=12", "checkpoint.every_steps=0")
    status = train_to_end(clean)
    assert status == "completed"
    assert not any((tmp_path / "clean" / "run" / "checkpoints").glob("step_*"))
    assert not [e for e in read_jsonl(tmp_path / "clean" / "run" / "events.jsonl") if e["event"] == "checkpoint_saved"]

    spiky = make_trainer(tmp_path / "spiky", "train.steps=34", "train.global_batch_size=8",
                         "train.micro_batch_size=8", "checkpoint.every_steps=0", "monitor.good_after_steps=5",
                         "faults=loss_spike", "faults.rank=0", "faults.step=30", "faults.num_steps=3")
    status = train_to_end(spiky)
    assert status == "stopped_divergence"
    events = read_jsonl(tmp_path / "spiky" / "run" / "events.jsonl")
    unavailable = [e for e in events if e["event"] == "rollback_unavailable"]
    assert [e["bad_step"] for e in unavailable] == [32]  # the step the rollback above goes back from
    assert not [e for e in events if e["event"] in ("rollback", "checkpoint_saved")]
    assert spiky.state.step == 32


def test_a_wandb_failure_disables_wandb_and_training_goes_on(tmp_path, caplog):
    """Observability never kills a run: an exception inside the W&B run (here log_metrics) turns W&B off with one
    message; the run completes and metrics.jsonl keeps every step."""
    trainer = make_trainer(tmp_path, "train.steps=3", "logging.wandb=true", "logging.wandb_mode=offline")
    assert trainer.observer.wandb is not None

    def broken(*args, **kwargs):
        raise RuntimeError("wandb-core went away")

    trainer.observer.wandb.log_metrics = broken
    status = train_to_end(trainer)
    assert status == "completed" and trainer.observer.wandb is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["W&B logging disabled after an error in log_metrics: RuntimeError: wandb-core went away"]
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_rank0_under_ray_without_the_drivers_run_directory_is_refused(tmp_path):
    """Under Ray the driver writes config.yaml into the run directory before the workers start; a rank 0 that does
    not see it runs on another filesystem (run_root not shared), where its results would be lost to the driver."""
    import pytest

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=debug_dense", "precision=bf16", "cluster.min_workers=1", "cluster.max_workers=1",
            "logging.wandb=false", "logging.ray_metrics=false", "train.steps=2", "train.warmup_steps=1",
            "checkpoint.report_to_ray=false", "data.seq_len=32"])
    config = {"job": to_dict(load_job_config(cfg)), "run_dir": str(tmp_path / "run"), "launcher": "ray"}
    with pytest.raises(RuntimeError, match="run_root must be on a filesystem shared by the driver"):
        Trainer(config).start()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not list(checkpoints.iterdir())  # refused before the step-0 save
    # With the driver's config.yaml present (what open_run_dir writes) the same start proceeds.
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    trainer = Trainer(config)
    trainer.start()
    assert [p.name for p in checkpoints.iterdir()] == ["step_000000"]


def test_the_checkpoint_a_run_resumes_from_still_becomes_good(tmp_path):
    """A checkpoint whose verdict was pending when its run stopped is marked good after good_after_steps clean
    steps of the resumed run (before, it never was, and a rollback went further back than needed)."""
    common = ("checkpoint.every_steps=10", "monitor.good_after_steps=5")
    first = make_trainer(tmp_path, "train.steps=12", *common)
    first.start()
    assert first.run() == "completed"  # saves 10 and the final 12, neither good yet (12 - 10 < 5 at the end)
    resumed = make_trainer(tmp_path, "train.steps=20", *common)
    resumed.start()
    assert resumed.state.step == 12 and resumed.checkpoints.manager.awaiting_good == {10, 12}
    assert resumed.run() == "completed"
    good = [e["step"] for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "checkpoint_good"]
    assert 12 in good and 10 in good


def _start_rank_with_own_corpus(rank: int, world: int, port: int, root: str) -> None:
    import os

    from tests.spawned import leave_rank

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from pathlib import Path

    trainer = make_trainer(Path(root), f"data.source={root}/corpus{rank}.txt", "data.seq_len=16")
    try:
        trainer.start()
        outcome = "started"
    except ValueError as exc:
        outcome = str(exc)
    (Path(root) / f"outcome{rank}.txt").write_text(outcome)
    leave_rank()  # the Trainer joined the group itself; leave it as every spawned test rank does


@pytest.mark.slow
def test_ranks_reading_different_corpora_are_refused(tmp_path):
    """Two gloo ranks whose data.source files differ (another node's copy) stop at start, naming both."""
    import torch.multiprocessing as mp

    from tests.spawned import free_port

    for rank in (0, 1):
        (tmp_path / f"corpus{rank}.txt").write_text(f"rank {rank} text " * 200)
    mp.spawn(_start_rank_with_own_corpus, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        outcome = (tmp_path / f"outcome{rank}.txt").read_text()
        assert "the ranks read different corpora" in outcome and "rank 0:" in outcome and "rank 1:" in outcome


def test_a_checkpoint_without_the_window_rule_is_refused_and_loses_nothing(tmp_path):
    """A checkpoint whose data_sampling records no window rule, or another one, maps sample indices to other windows
    than this version reads: the resume is refused, naming the rule, and the run directory stays as it was."""
    import json

    from orchestration.checkpoint.directory import EXTRA_STATE, file_digests

    first = make_trainer(tmp_path, "precision=bf16", "train.steps=2")
    first.start()
    assert first.ctx.dataset.window_rule == 2 and first.checkpoints.data_sampling()["window_rule"] == 2
    first.finish(first.run())

    def rewrite_rule(rule):
        for step_dir in (tmp_path / "run" / "checkpoints").glob("step_*"):
            extra = json.loads((step_dir / EXTRA_STATE).read_text())
            extra["data_sampling"].pop("window_rule", None)
            if rule is not None:
                extra["data_sampling"]["window_rule"] = rule
            (step_dir / EXTRA_STATE).write_text(json.dumps(extra))
            manifest = json.loads((step_dir / "manifest.json").read_text())  # its checksum follows the edited file
            digest = file_digests([step_dir / EXTRA_STATE], manifest["checksum"], manifest["chunk_bytes"])[0]
            manifest["files"][EXTRA_STATE] = {"size": (step_dir / EXTRA_STATE).stat().st_size, "digest": digest}
            (step_dir / "manifest.json").write_text(json.dumps(manifest))

    for rule, named in ((None, "no recorded window rule"), (3, "window rule 3")):
        rewrite_rule(rule)
        before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()
                  and p.name != "events.jsonl"}
        resumed = make_trainer(tmp_path, "precision=bf16", "train.steps=3")
        with pytest.raises(ValueError, match=f"step_000002 maps sample indices to windows with {named}, and this "
                                             "version reads rule 2 only: .*choose a new run_name"):
            resumed.start()
        after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()
                 and p.name != "events.jsonl"}
        assert after == before


# ----------------------------------------------------------------------------- interpreter cases (child process)

def _interp_the_gated_update_skips_exactly_the_step_the_guard_rejects(tmp_path, monkeypatch):
    """The worker launches the step's update (optim.ChunkedAdamW, in the Triton interpreter here, and the MoE router's
    aux-loss-free bias update) before the guard's host read, gated on the device: a NaN gradient at step 2 must leave
    the weights, AdamW's step counts and the router biases as they were (the expert counts carried to the next kept
    step), and every other step must apply once (orchestration.divergence.agreement.agree_and_decide)."""
    import torch

    import orchestration.training.optimizer as optimizer_mod
    from optim import ChunkedAdamW

    monkeypatch.setattr(optimizer_mod, "adamw_implementation", lambda job, device: "triton")
    trainer = make_trainer(tmp_path, "model=debug_moe", "+model.overrides.aux_free_bias=true", "precision=bf16",
                           "train.steps=4", "faults=nan_grad", "faults.rank=0", "faults.step=2")
    moe = trainer.state.model.layers["1"].moe
    assert isinstance(trainer.state.optimizer, ChunkedAdamW)
    record, biases = {}, {}
    check = trainer.guard.check

    def recorded(*args, **kwargs):
        before = [p.detach().clone() for p in trainer.state.model.parameters()]
        launches = trainer.state.optimizer.kernel_steps
        bias, counts = moe.expert_bias.clone(), moe.tokens_per_expert.clone()
        decision, update_applied = check(*args, **kwargs)
        biases[trainer.state.step] = (bias, moe.expert_bias.clone(), counts, moe.tokens_per_expert.clone())
        counts = {trainer.state.optimizer.state[p]["step"].item() for p in trainer.state.model.parameters()}
        record[trainer.state.step] = (decision.kind, update_applied, before,
                                      trainer.state.optimizer.kernel_steps - launches, counts)
        return decision, update_applied

    trainer.guard.check = recorded
    trainer.start()
    assert trainer.run() == "completed"
    after = [p.detach().clone() for p in trainer.state.model.parameters()]
    # One launch a step, in the guard (before its host read); the step counts do not advance at the skipped step.
    assert [(s, r[0], r[1], r[3]) for s, r in sorted(record.items())] == [
        (0, "proceed", True, 1), (1, "proceed", True, 1), (2, "skip_step", False, 1), (3, "proceed", True, 1)]
    (c0,), (c1,), (c2,), (c3,) = (record[s][4] for s in range(4))
    assert (c1 - c0, c2 - c1, c3 - c2) == (1.0, 0.0, 1.0)
    for s, (bias_before, bias_after, counts_before, counts_after) in biases.items():
        assert counts_before.sum() > 0
        if s == 2:  # rejected: the bias stays, the counts wait for the next kept step
            assert torch.equal(bias_after, bias_before) and torch.equal(counts_after, counts_before)
        else:
            assert not torch.equal(bias_after, bias_before) and not counts_after.any()
    weights = [record[s][2] for s in range(4)] + [after]
    for s in range(4):
        same = all(torch.equal(a, b) for a, b in zip(weights[s], weights[s + 1]))
        assert same == (s == 2), s


expose_or_run(globals(), __file__, 1, "test_guard_cases_in_the_triton_interpreter")
