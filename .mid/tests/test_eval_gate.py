"""The in-run FP8 quality gate: at each held-out evaluation of an FP8 run the same weights are evaluated in BF16 too,
and a relative gap above monitor.eval_gap_max falls back to BF16 under the policy's cool-down / retry / relapse
rules. One worker in this process (the real Trainer, FP8 emulated on CPU, the byte stream's held-out files); the
fp8_scale_error fault makes the FP8 path worse without NaNs."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestration.config import to_dict
from orchestration.observability.events import read_jsonl
from orchestration.training.loop import Trainer
from orchestration.validation import load_job_config

REPO = Path(__file__).resolve().parent.parent


def run(tmp_path: Path, *overrides: str) -> tuple[list[dict], list[dict]]:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=debug_dense", "precision=fp8", "cluster.min_workers=1", "cluster.max_workers=1",
            "logging.wandb=false", "logging.ray_metrics=false", "train.global_batch_size=4", "train.micro_batch_size=4",
            "data.seq_len=32", "data.eval_sequences=8", "train.log_every=5", "train.warmup_steps=2",
            "train.eval_every=10", "checkpoint.every_steps=1000", "monitor.cooldown_steps=10", *overrides])
    job = load_job_config(cfg)
    trainer = Trainer({"job": to_dict(job), "run_dir": str(tmp_path / "run")})
    trainer.start()
    trainer.finish(trainer.run())
    run_dir = tmp_path / "run"
    return read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")


def test_clean_fp8_run_measures_the_gap_and_keeps_fp8(tmp_path):
    metrics, events = run(tmp_path, "train.steps=20")
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evals] == [10, 20]
    for m in evals:
        assert m["eval_gap"] == (m["eval_loss"] - m["eval_loss_bf16"]) / m["eval_loss_bf16"]
        assert abs(m["eval_gap"]) < 0.02 and m["eval_loss"] != m["eval_loss_bf16"]  # two real evaluations
        assert m["precision"] == "fp8"
    assert not [e for e in events if e["event"] in ("eval_gap_exceeded", "precision_changed")]


def test_fp8_scale_error_falls_back_at_the_eval(tmp_path):
    """The fault starts at step 20, where the evaluation runs before any faulted training step: the same weights
    evaluate worse in FP8 than in BF16, the gap exceeds monitor.eval_gap_max, the run falls back to BF16 at once,
    and the next evaluation (in the cool-down) runs in BF16 only."""
    metrics, events = run(tmp_path, "train.steps=30", "faults=fp8_scale_error", "faults.step=20")
    by_step = {m["step"]: m for m in metrics}
    assert abs(by_step[10]["eval_gap"]) < 0.02  # clean before the fault
    (exceeded,) = [e for e in events if e["event"] == "eval_gap_exceeded"]
    m = by_step[20]
    assert exceeded["step"] == 20 and exceeded["threshold"] == 0.02
    assert exceeded["eval_loss_fp8"] == m["eval_loss"] and exceeded["eval_loss_bf16"] == m["eval_loss_bf16"]
    assert exceeded["rel_gap"] == m["eval_gap"] > 0.05  # the FP8 path clearly worse, and finite
    detected = [e for e in events if e["event"] == "divergence_detected"]
    assert [(e["step"], e["detector"]) for e in detected] == [(20, "eval_gap")]
    assert [(e["step"], e["to"]) for e in events if e["event"] == "precision_changed"] == [(20, "bf16")]
    assert m["precision"] == "bf16"  # logged after the decision
    assert by_step[30]["precision"] == "bf16" and "eval_loss_bf16" not in by_step[30] and by_step[30]["eval_loss"]


def test_eval_gap_follows_the_fallback_rules_of_fp8_findings():
    """decide_eval_gap: a fallback with the cool-down, FP8 retried when it ends, a relapse within relapse_window,
    permanent BF16 after max_relapses; nothing while BF16 is in force."""
    from orchestration.config import MonitorConfig
    from orchestration.divergence.monitor import Finding, MonitorReport
    from orchestration.divergence.policy import DivergencePolicy, FallbackToBF16, Proceed, RetryFP8

    policy = DivergencePolicy(MonitorConfig(cooldown_steps=10, relapse_window=50, max_relapses=1))

    def gap(step):
        return policy.decide_eval_gap(Finding("eval_gap", 0, 0.05, 0.02, step))

    first = gap(20)
    assert isinstance(first, FallbackToBF16) and first.until_step == 30 and first.scope is None
    assert isinstance(gap(25), Proceed)  # in the cool-down: the model runs BF16, FP8 findings do not apply
    assert isinstance(policy.decide(MonitorReport(29), 29), Proceed)
    assert isinstance(policy.decide(MonitorReport(30), 30), RetryFP8)
    relapse = gap(40)  # within relapse_window of the retry: the last one max_relapses=1 allows
    assert isinstance(relapse, FallbackToBF16) and relapse.permanent and policy.precision == "bf16"
    assert [e["event"] for e in relapse.events()][:1] == ["divergence_detected"]
