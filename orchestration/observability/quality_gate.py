"""FP8 quality gate across runs: held-out eval loss of an FP8 run against a BF16 run of the same job.

    python -m orchestration.report --gate BF16_RUN FP8_RUN --max-rel-gap 0.01 [--out DIR]

At every step both runs evaluated (eval_loss in metrics.jsonl, the value logged last for a step that a rollback
re-ran; null, a non-finite evaluation, counts as NaN), the relative gap is (eval_fp8 - eval_bf16) / eval_bf16. The gate passes when no gap exceeds max_rel_gap
(FP8 better than BF16 passes) and every FP8 eval is finite. It prints a verdict table, draws both curves and the gap
(quality_gate.png in the FP8 run directory, or --out), and the command exits 1 when the gate fails, 2 when the runs
cannot be compared (no eval_loss, no common step): usable as a CI step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from orchestration.observability.events import METRICS_FILE, read_jsonl

GATE_PLOT = "quality_gate.png"


@dataclass(frozen=True)
class GateRow:
    step: int
    bf16: float
    fp8: float
    rel_gap: float
    ok: bool


@dataclass(frozen=True)
class GateResult:
    rows: list[GateRow]
    max_rel_gap: float

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def worst(self) -> GateRow:
        return max(self.rows, key=lambda r: r.rel_gap if math.isfinite(r.rel_gap) else math.inf)


def eval_curve(run_dir: Path) -> dict[int, float]:
    """step -> eval_loss of a run (the value logged last for a step), sorted by step."""
    metrics_file = Path(run_dir) / METRICS_FILE
    if not metrics_file.is_file():
        raise ValueError(f"{run_dir} is not a run directory (no {METRICS_FILE})")
    curve: dict[int, float] = {}
    for record in read_jsonl(metrics_file):
        if "eval_loss" in record and "step" in record:
            # metrics.jsonl writes a non-finite value as null: an evaluation that gave NaN or inf.
            value = record["eval_loss"]
            curve[int(record["step"])] = float(value) if isinstance(value, (int, float)) else math.nan
    if not curve:
        raise ValueError(f"{run_dir} logged no eval_loss: run it with train.eval_every > 0 (and data with a "
                         "validation split)")
    return dict(sorted(curve.items()))


def compare(bf16: dict[int, float], fp8: dict[int, float], max_rel_gap: float) -> GateResult:
    """The gate's verdict at every step both curves have (pure). ValueError when they share none."""
    steps = sorted(set(bf16) & set(fp8))
    if not steps:
        raise ValueError(f"the runs evaluated at no common step (bf16: {list(bf16)[:5]}..., fp8: {list(fp8)[:5]}...): "
                         "run both with the same train.eval_every")
    rows = []
    for step in steps:
        a, b = bf16[step], fp8[step]
        gap = (b - a) / abs(a) if math.isfinite(a) and math.isfinite(b) and a != 0 else math.inf
        rows.append(GateRow(step, a, b, gap, math.isfinite(b) and gap <= max_rel_gap))
    return GateResult(rows, max_rel_gap)


def verdict_table(result: GateResult, bf16_label: str, fp8_label: str) -> str:
    lines = [f"FP8 quality gate: {fp8_label} vs {bf16_label}, max relative eval-loss gap {result.max_rel_gap:.2%}",
             f"{'step':>8}  {'eval bf16':>10}  {'eval fp8':>10}  {'gap':>8}  verdict"]
    for r in result.rows:
        lines.append(f"{r.step:>8}  {r.bf16:>10.4f}  {r.fp8:>10.4f}  {r.rel_gap:>+8.2%}  {'ok' if r.ok else 'FAIL'}")
    worst = result.worst
    lines.append(f"{'PASS' if result.passed else 'FAIL'}: largest gap {worst.rel_gap:+.2%} at step {worst.step} "
                 f"({sum(not r.ok for r in result.rows)} of {len(result.rows)} steps above the limit)")
    return "\n".join(lines)


def plot_gate(result: GateResult, bf16_label: str, fp8_label: str, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot, no GUI backend

    fig = Figure(figsize=(9, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    steps = [r.step for r in result.rows]
    top.plot(steps, [r.bf16 for r in result.rows], marker="o", color="#1f77b4", label=f"bf16: {bf16_label}")
    top.plot(steps, [r.fp8 for r in result.rows], marker="o", color="#2ca02c", label=f"fp8: {fp8_label}")
    top.set_ylabel("eval loss")
    top.set_title(f"FP8 quality gate: {'PASS' if result.passed else 'FAIL'}")
    top.grid(alpha=0.3)
    top.legend()
    bottom.plot(steps, [100 * r.rel_gap for r in result.rows], marker="o", color="#d62728")
    bottom.axhline(100 * result.max_rel_gap, color="#d62728", linestyle="--", linewidth=1, label="limit")
    bottom.axhline(0, color="#888888", linewidth=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel("(fp8 - bf16) / bf16, %")
    bottom.grid(alpha=0.3)
    bottom.legend()
    fig.savefig(path, dpi=100)


def run_gate(bf16_run: Path, fp8_run: Path, max_rel_gap: float, out_dir: Path | None = None) -> tuple[GateResult, str,
                                                                                                       Path]:
    """Read both runs, compare, draw. Returns (result, verdict table, plot path); ValueError when not comparable."""
    if not max_rel_gap >= 0:
        raise ValueError(f"--max-rel-gap must be >= 0, got {max_rel_gap}")
    result = compare(eval_curve(bf16_run), eval_curve(fp8_run), max_rel_gap)
    bf16_label, fp8_label = Path(bf16_run).name, Path(fp8_run).name
    out = Path(out_dir) if out_dir is not None else Path(fp8_run)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = out / GATE_PLOT
    plot_gate(result, bf16_label, fp8_label, plot_path)
    return result, verdict_table(result, bf16_label, fp8_label), plot_path
