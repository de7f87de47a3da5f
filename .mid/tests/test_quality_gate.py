"""The FP8 quality gate across runs (orchestration.observability.quality_gate and `report --gate`): the verdict rule
at matching steps, the table, the plot and the exit codes, on metrics.jsonl files written as the worker writes them.
The gate on real runs (bf16 vs fp8 emulated, and a regressed run) is in tests/test_eval_e2e.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from orchestration.observability.quality_gate import GATE_PLOT, compare, eval_curve, run_gate
from orchestration.report import main as report_main


def write_run(path: Path, evals: dict[int, float], extra_steps: tuple[int, ...] = (), precision: str | None = None,
              events: tuple[dict, ...] = (), **settings: object) -> Path:
    """A run directory as the worker writes it: metrics.jsonl, and config.yaml (precision, the GATE_KEYS) and
    events.jsonl; precision defaults to the directory's name."""
    import yaml

    path.mkdir(parents=True)
    records = [{"step": s, "loss": 3.0, "eval_loss": v, "eval_s": 0.1} for s, v in evals.items()]
    records += [{"step": s, "loss": 3.0} for s in extra_steps]  # steps logged without an eval
    records.sort(key=lambda r: r["step"])
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"model": {"name": "debug_dense", "overrides": {}}, "precision": {"name": precision or path.name},
              "data": {"name": "stdlib", "seq_len": 64, "seed": 1234}, "train": {"seed": 0, "global_batch_size": 8}}
    for key, value in settings.items():
        section, field = key.split("__")
        config[section][field] = value
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    all_events = [{"time": 0.0, "event": "run_start", "step": 0}, *events]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in all_events))
    return path


def test_gap_rule_at_matching_steps():
    bf16 = {10: 4.0, 20: 3.0, 30: 2.5}
    fp8 = {10: 4.02, 20: 3.06, 30: 2.4, 40: 2.3}  # step 40: bf16 did not evaluate there, not compared
    result = compare(bf16, fp8, max_rel_gap=0.01)
    assert [r.step for r in result.rows] == [10, 20, 30]
    assert [round(r.rel_gap, 6) for r in result.rows] == [0.005, 0.02, -0.04]
    assert [r.ok for r in result.rows] == [True, False, True]  # FP8 better than BF16 passes
    assert not result.passed and result.worst.step == 20
    assert compare(bf16, fp8, max_rel_gap=0.03).passed
    assert compare({5: 4.0}, {5: 4.0625}, max_rel_gap=0.015625).passed  # the limit is inclusive (exact binary values)
    nan = compare({10: 4.0}, {10: math.nan}, max_rel_gap=1.0)
    assert not nan.passed and nan.rows[0].rel_gap == math.inf
    with pytest.raises(ValueError, match="no common step"):
        compare({10: 4.0}, {20: 4.0}, 0.01)


def test_effective_curve_takes_the_value_logged_last(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 10, "eval_loss": 5.0}, {"step": 20, "eval_loss": 9.0}, {"step": 11, "loss": 1.0},
             {"step": 20, "eval_loss": 4.0},  # step 20 re-run after a rollback
             {"step": 30, "eval_loss": None}]  # a non-finite evaluation (metrics.jsonl writes it as null)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    curve = eval_curve(run)
    assert list(curve) == [10, 20, 30] and curve[10] == 5.0 and curve[20] == 4.0 and math.isnan(curve[30])


def test_report_gate_cli_pass_fail_and_not_comparable(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", {10: 4.0, 20: 3.0}, extra_steps=(5, 15))
    fp8 = write_run(tmp_path / "fp8", {10: 4.01, 20: 3.02})
    assert report_main(["--gate", str(bf16), str(fp8), "--max-rel-gap", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "PASS: largest gap +0.67% at step 20" in out and "+0.25%" in out
    assert (fp8 / GATE_PLOT).stat().st_size > 10_000  # a real PNG, two curves and the gap

    assert report_main(["--gate", str(bf16), str(fp8), "--max-rel-gap", "0.005", "--out",
                        str(tmp_path / "gate")]) == 1
    out = capsys.readouterr().out
    assert "FAIL: largest gap +0.67% at step 20 (1 of 2 steps above the limit)" in out
    assert (tmp_path / "gate" / GATE_PLOT).is_file()

    no_eval = tmp_path / "no_eval"
    no_eval.mkdir()
    (no_eval / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert report_main(["--gate", str(bf16), str(no_eval)]) == 2
    assert "logged no eval_loss: run it with train.eval_every > 0" in capsys.readouterr().err


def test_run_gate_refuses_a_negative_limit(tmp_path):
    bf16 = write_run(tmp_path / "a", {10: 4.0})
    with pytest.raises(ValueError, match="--max-rel-gap must be >= 0"):
        run_gate(bf16, bf16, -0.1)


def fallback(step: int, scope: object = "model", to: str = "bf16") -> dict:
    return {"time": float(step), "event": "precision_changed", "step": step, "from": "fp8" if to == "bf16" else "bf16",
            "to": to, "scope": scope}


def test_gate_refuses_a_swapped_pair_a_fallen_back_run_and_another_job(tmp_path, capsys):
    """Exit 2 naming what is wrong, before any verdict: the FP8 run given as the baseline; an FP8 run that fell
    back to BF16 (whole model, or some layers) before a compared step; another model or data seed. --allow-mismatch
    compares anyway and prints the differences; a fallback after the last compared step, undone by a retry before
    the compared steps, does not count."""
    bf16 = write_run(tmp_path / "bf16", {10: 4.0, 20: 3.0})
    fp8 = write_run(tmp_path / "fp8", {10: 4.01, 20: 3.02})
    assert report_main(["--gate", str(fp8), str(bf16)]) == 2
    err = capsys.readouterr().err
    assert "BF16_RUN trained in fp8, not bf16, at 2 of the 2 compared steps (first: step 10)" in err, err
    assert "FP8_RUN trained in bf16, not fp8, at 2 of the 2 compared steps" in err and "--allow-mismatch" in err

    fell_back = write_run(tmp_path / "fell_back", {10: 4.01, 20: 3.0}, precision="fp8", events=(fallback(15),))
    assert report_main(["--gate", str(bf16), str(fell_back)]) == 2
    assert "FP8_RUN trained in bf16, not fp8, at 1 of the 2 compared steps (first: step 20)" in capsys.readouterr().err
    layers = write_run(tmp_path / "layers", {10: 4.01, 20: 3.0}, precision="fp8",
                       events=(fallback(10, ["layers.0"]), fallback(12, ["layers.0", "layers.1"])))
    assert report_main(["--gate", str(bf16), str(layers)]) == 2
    assert "FP8_RUN trained in fp8 with 1 layers in bf16, not fp8, at 2 of the 2" in capsys.readouterr().err
    assert report_main(["--gate", str(bf16), str(layers), "--allow-mismatch"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mismatch (allowed): FP8_RUN trained in fp8 with 1 layers in bf16") and "PASS" in out

    recovered = write_run(tmp_path / "recovered", {10: 4.01, 20: 3.02}, precision="fp8",
                          events=(fallback(3), fallback(8, to="fp8"), fallback(25)))
    assert report_main(["--gate", str(bf16), str(recovered)]) == 0
    capsys.readouterr()

    other = write_run(tmp_path / "other", {10: 4.01, 20: 3.02}, precision="fp8", model__name="debug_moe",
                      data__seed=5)
    assert report_main(["--gate", str(bf16), str(other)]) == 2
    err = capsys.readouterr().err
    assert "model.name differs (BF16_RUN 'debug_dense', FP8_RUN 'debug_moe')" in err
    assert "data.seed differs (BF16_RUN 1234, FP8_RUN 5)" in err
