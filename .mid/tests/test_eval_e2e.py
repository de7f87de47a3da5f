"""Training on a prepared corpus with held-out evaluation, end to end on a real local Ray cluster (2 workers): a BPE
tokenizer trained here, a corpus prepared by the command, a run that stops and resumes with exact sample accounting
and its evaluations in metrics.jsonl, W&B (offline) and summary.json, a resume on another corpus refused before Ray
starts, and the FP8 quality gate on real runs (bf16 vs emulated fp8 from the same initialisation: pass; a faulted
run: fail). Also the evaluation itself across world sizes with real gloo process groups. Slow: a few minutes."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from orchestration.observability.events import read_jsonl
from tests.conftest import REPO, launch
from tests.spawned import free_port, rank_process_group

pytestmark = pytest.mark.slow

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_DIRS = [STDLIB / "json", STDLIB / "email", STDLIB / "logging", STDLIB / "importlib"]
VOCAB = 1000  # not a multiple of 16: the debug model takes 1008
GLOBAL_BATCH = 16


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, check=False)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    """(the corpus the runs train on, a second one of the same text split otherwise) and the tokenizer."""
    root = tmp_path_factory.mktemp("data")
    tok = root / "tokenizer.json"
    proc = run_module("orchestration.data.train_tokenizer", "--input", *map(str, CORPUS_DIRS), "--vocab-size",
                      str(VOCAB), "--out", str(tok))
    assert proc.returncode == 0, proc.stderr
    paths = []
    for name, fraction in (("main", "0.1"), ("other", "0.2")):
        proc = run_module("orchestration.data.prepare", "--input", *map(str, CORPUS_DIRS), "--tokenizer", str(tok),
                          "--out", str(root / name), "--val-fraction", fraction, "--workers", "2")
        assert proc.returncode == 0, proc.stderr
        paths.append(root / name)
    return paths[0], paths[1]


def common(corpus: Path, run_root: Path, name: str) -> list[str]:
    return [f"run_root={run_root}", f"run_name={name}", "model=debug_dense", "data=tokenized", f"data.path={corpus}",
            "data.seq_len=64", "data.eval_sequences=16", "train.eval_every=10", "train.log_every=5",
            "checkpoint.every_steps=10", "train.warmup_steps=2", f"train.global_batch_size={GLOBAL_BATCH}",
            "logging.progress_every_s=10"]


def evals_of(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["eval_loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in m}


def test_tokenized_run_evaluates_resumes_exactly_and_refuses_another_corpus(corpora, tmp_path, isolated_env,
                                                                           no_ray_leftovers):
    corpus, other = corpora
    runs = tmp_path / "runs"
    args = common(corpus, runs, "tok") + ["precision=bf16"]
    first = launch(isolated_env, *args, "train.steps=20")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = launch(isolated_env, *args, "train.steps=30")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    run_dir = runs / "tok"

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    digest = hashlib.sha256((corpus / "manifest.json").read_bytes()).hexdigest()
    assert config["data"]["manifest_sha256"] == digest and config["data"]["path"] == str(corpus)
    assert config["model"]["overrides"]["vocab_size"] == 1008  # the tokenizer's 1000 rounded up to 16
    events = read_jsonl(run_dir / "events.jsonl")
    resumes = [e for e in events if e["event"] == "resume"]
    assert [e["from_step"] for e in resumes] == [20] and resumes[0]["world_size"] == 2

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    # every step logged once, none repeated: train.log_every, and the first step of each start
    assert [m["step"] for m in metrics] == [1, 5, 10, 15, 20, 21, 25, 30]
    evals = evals_of(run_dir)
    assert sorted(evals) == [10, 20, 30]  # train.eval_every and the last step of each start
    assert all(m["eval_sequences"] == 16 and m["eval_s"] > 0 for m in metrics if "eval_loss" in m)
    # Held-out loss starts near ln(1008) = 6.92 and must fall as the model learns the corpus.
    assert evals[30] < evals[20] < evals[10] < math.log(1008)
    assert evals[30] < evals[10] - 0.5

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] == evals[30] and summary["final_eval_step"] == 30
    assert summary["eval_s_mean"] > 0
    assert summary["consumed_ranges"] == [[0, 30 * GLOBAL_BATCH]] and summary["skipped_ranges"] == []
    assert "final eval loss" in second.stdout and " eval " in second.stdout  # summary table, progress line

    from orchestration.observability.wandb_offline import read_offline_history

    history = {row["step"]: row["eval_loss"] for row in read_offline_history(run_dir) if "eval_loss" in row}
    assert history == pytest.approx(evals, rel=1e-9)

    # The same run name on the other corpus: refused by the launcher before Ray starts, naming the manifest digests,
    # nothing in the run directory changed.
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file())
    third = launch(isolated_env, *common(other, runs, "tok"), "precision=bf16", "train.steps=40", timeout=120)
    assert third.returncode == 2, third.stdout[-3000:] + third.stderr[-3000:]
    other_digest = hashlib.sha256((other / "manifest.json").read_bytes()).hexdigest()
    assert f"data.manifest_sha256 (saved '{digest}', now '{other_digest}')" in third.stderr
    assert "Ray dashboard" not in third.stdout
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()) == before


def test_model_vocabulary_smaller_than_the_tokenizer_is_refused_before_ray(corpora, tmp_path, isolated_env):
    corpus, _ = corpora
    proc = launch(isolated_env, *common(corpus, tmp_path, "small"), "+model.overrides.vocab_size=512", timeout=120)
    assert proc.returncode == 2
    assert ("model.overrides.vocab_size: model debug_dense has vocab_size=512, below the 1000 token ids of the "
            f"tokenizer of data.path={corpus}; set model.overrides.vocab_size to at least 1000") in proc.stderr
    assert "Ray dashboard" not in proc.stdout and not (tmp_path / "small").exists()


def test_quality_gate_on_real_runs(corpora, tmp_path, isolated_env, no_ray_leftovers):
    """bf16 and emulated fp8 from the same initialisation pass the 1% gate at every evaluation; an fp8 run whose FP8
    outputs get scale errors from step 12 on (faults=fp8_scale_error), with the monitors off so that nothing falls
    back, fails it at every later evaluation, without a NaN."""
    corpus, _ = corpora
    runs = tmp_path / "runs"
    for name, extra in (("bf16", ["precision=bf16"]), ("fp8", ["precision=fp8"]),
                        ("faulted", ["precision=fp8", "faults=fp8_scale_error", "faults.step=12", "monitor=off"])):
        proc = launch(isolated_env, *common(corpus, runs, name), "train.steps=30", "logging.wandb=false", *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bf16, fp8, faulted = evals_of(runs / "bf16"), evals_of(runs / "fp8"), evals_of(runs / "faulted")
    assert sorted(bf16) == sorted(fp8) == sorted(faulted) == [10, 20, 30]
    # Identical to the fp8 run until the fault starts at step 12; measurably worse than bf16 after it, and finite.
    assert faulted[10] == pytest.approx(fp8[10], rel=1e-6)
    assert all(math.isfinite(faulted[s]) and faulted[s] > 1.01 * bf16[s] for s in (20, 30))
    def gate(run: str, *extra: str) -> subprocess.CompletedProcess:
        return run_module("orchestration.report", "--gate", str(runs / "bf16"), str(runs / run),
                          "--max-rel-gap", "0.01", *extra)

    passed = gate("fp8")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "PASS: largest gap" in passed.stdout and (runs / "fp8" / "quality_gate.png").is_file()
    for step in (10, 20, 30):
        assert abs(fp8[step] - bf16[step]) / bf16[step] <= 0.01
    failed = gate("faulted", "--out", str(tmp_path / "gate"))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "FAIL: largest gap +" in failed.stdout and "(2 of 3 steps above the limit)" in failed.stdout
    assert (tmp_path / "gate" / "quality_gate.png").is_file()


def _evaluate_rank(rank: int, world_size: int, port: int, corpus: str, out: str) -> None:
    from models.loss import model_lm_loss
    from models.registry import build_model
    from orchestration.data.shards import TokenizedDataset
    from orchestration.training.evaluation import eval_forwards, evaluate

    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world_size):
        data = TokenizedDataset(Path(corpus), seq_len=64, seed=0)
        model = build_model("debug_dense", device="cpu", overrides={"vocab_size": 1008}, seed=3)
        forwards = []

        def loss_fn(x, y):
            forwards.append(len(x))
            return model_lm_loss(model, x, y, compiled=False)

        loss = evaluate(model, data, 10, 2, rank, world_size, torch.device("cpu"), loss_fn)
        assert len(forwards) == eval_forwards(10, world_size, 2)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"loss": loss, "training": model.training}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_loss_is_the_same_at_every_world_size(corpora, tmp_path, world_size):
    """10 validation sequences over 1, 2 or 3 gloo ranks (3: chunks of 4, 3, 3, every rank runs 2 forwards): the same
    loss, equal to the mean token loss of the 10 sequences computed in one batch."""
    corpus, _ = corpora
    from models.loss import model_lm_loss
    from models.registry import build_model
    from orchestration.data.shards import TokenizedDataset

    model = build_model("debug_dense", device="cpu", overrides={"vocab_size": 1008}, seed=3)
    inputs, targets = TokenizedDataset(corpus, seq_len=64, seed=0).validation_batch(0, 10)
    with torch.no_grad():
        reference = model_lm_loss(model.eval(), inputs, targets, compiled=False).item()
    mp.spawn(_evaluate_rank, args=(world_size, free_port(), str(corpus), str(tmp_path)), nprocs=world_size)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert all(r["loss"] == results[0]["loss"] for r in results)  # one all-reduced value on every rank
    assert results[0]["loss"] == pytest.approx(reference, rel=1e-6)
    assert all(r["training"] for r in results)  # train mode restored after the evaluation
