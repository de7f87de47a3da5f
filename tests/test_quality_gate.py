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


def write_run(path: Path, evals: dict[int, float], extra_steps: tuple[int, ...] = ()) -> Path:
    path.mkdir(parents=True)
    records = [{"step": s, "loss": 3.0, "eval_loss": v, "eval_s": 0.1} for s, v in evals.items()]
    records += [{"step": s, "loss": 3.0} for s in extra_steps]  # steps logged without an eval
    records.sort(key=lambda r: r["step"])
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
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
