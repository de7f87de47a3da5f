"""FP8 quality gate across runs: held-out eval loss of an FP8 run against a BF16 run of the same job.

    python -m orchestration.report --gate BF16_RUN FP8_RUN --max-rel-gap 0.01 [--out DIR]

At every step both runs evaluated (eval_loss in metrics.jsonl, the value logged last for a step that a rollback
re-ran; null, a non-finite evaluation, counts as NaN), the relative gap is (eval_fp8 - eval_bf16) / eval_bf16. The gate passes when no gap exceeds max_rel_gap
(FP8 better than BF16 passes) and every FP8 eval is finite. It prints a verdict table, draws both curves and the gap
(quality_gate.png in the FP8 run directory, or --out), and the command exits 1 when the gate fails, 2 when the runs
cannot be compared (no eval_loss, no common step): usable as a CI step.

Before comparing, the gate checks its inputs (check_inputs): at every compared step the BF16 run trained in BF16
and the FP8 run in FP8 as its events tell (config.yaml's precision, then each precision_changed event: a run that
fell back to BF16, whole or some layers, before a compared step is not an FP8 run there), and both ran the same
model, data, seeds and batch (GATE_KEYS of config.yaml). A swapped pair or such a run exits 2 naming what differs,
unless --allow-mismatch (then the differences are printed above the table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from orchestration.observability.events import CONFIG_FILE, EVENTS_FILE, METRICS_FILE, read_jsonl

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


# What two runs must share for their eval losses to measure FP8 against BF16 and nothing else: the model, the
# training and held-out data, the seeds (initialisation, sample order) and the tokens per step.
GATE_KEYS = ("model.name", "model.overrides", "data.name", "data.source", "data.glob", "data.max_files", "data.path",
             "data.manifest_sha256", "data.seq_len", "data.seed", "data.eval_sequences", "train.seed",
             "train.global_batch_size")


class GateInputError(ValueError):
    """The two runs are not a BF16 run and an FP8 run of the same job at the compared steps."""


def read_config(run_dir: Path) -> dict:
    import yaml

    path = Path(run_dir) / CONFIG_FILE
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise GateInputError(f"{run_dir}: cannot read {CONFIG_FILE} ({exc}), so what the run trained cannot be "
                             "checked; pass --allow-mismatch to compare anyway") from None
    return config if isinstance(config, dict) else {}


def _lookup(tree: object, dotted: str) -> object:
    for part in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


def precision_by_step(config: dict, events: list[dict], steps: list[int]) -> dict[int, str]:
    """The precision a run trained in at each step (pure): 'fp8', 'bf16', or 'fp8 with N layers in bf16', from its
    configured precision and its precision_changed events up to and including that step (a change decided at step s
    is in force for s's update and the evaluation after it)."""
    changes = sorted((int(e.get("step", 0)), i, e) for i, e in enumerate(events) if e.get("event") == "precision_changed")
    out = {}
    for step in steps:
        whole, layers = str(_lookup(config, "precision.name")), set()
        for at, _, e in changes:
            if at > step:
                break
            to, scope = str(e.get("to")).lower(), e.get("scope", "model")
            if to == "fp8":
                whole, layers = "fp8", set()
            elif scope == "model" or not isinstance(scope, list):
                whole, layers = "bf16", set()
            else:
                layers = set(scope)
        out[step] = f"fp8 with {len(layers)} layers in bf16" if whole == "fp8" and layers else whole
    return out


def check_inputs(bf16_config: dict, bf16_events: list[dict], fp8_config: dict, fp8_events: list[dict],
                 steps: list[int]) -> list[str]:
    """What makes the pair unfit for the gate at `steps` (pure; [] when fit)."""
    problems = []
    for label, want, config, events in (("BF16_RUN", "bf16", bf16_config, bf16_events),
                                        ("FP8_RUN", "fp8", fp8_config, fp8_events)):
        wrong = {s: p for s, p in precision_by_step(config, events, steps).items() if p != want}
        if wrong:
            first = min(wrong)
            problems.append(f"{label} trained in {wrong[first]}, not {want}, at {len(wrong)} of the {len(steps)} "
                            f"compared steps (first: step {first})")
    for key in GATE_KEYS:
        a, b = _lookup(bf16_config, key), _lookup(fp8_config, key)
        if a != b:
            problems.append(f"{key} differs (BF16_RUN {a!r}, FP8_RUN {b!r})")
    return problems


def run_gate(bf16_run: Path, fp8_run: Path, max_rel_gap: float, out_dir: Path | None = None,
             allow_mismatch: bool = False) -> tuple[GateResult, str, Path]:
    """Read both runs, check they are a BF16 and an FP8 run of one job (GateInputError otherwise, unless
    allow_mismatch), compare, draw. Returns (result, verdict table, plot path); ValueError when not comparable."""
    if not max_rel_gap >= 0:
        raise ValueError(f"--max-rel-gap must be >= 0, got {max_rel_gap}")
    result = compare(eval_curve(bf16_run), eval_curve(fp8_run), max_rel_gap)
    problems: list[str] = []
    try:
        problems = check_inputs(read_config(bf16_run), read_jsonl(Path(bf16_run) / EVENTS_FILE),
                                read_config(fp8_run), read_jsonl(Path(fp8_run) / EVENTS_FILE),
                                [r.step for r in result.rows])
    except GateInputError as exc:
        problems = [str(exc)]
    if problems and not allow_mismatch:
        raise GateInputError(f"the runs are not a BF16 and an FP8 run of the same job: {'; '.join(problems)}. Give "
                             "the BF16 run first and an FP8 run that stayed in FP8, or pass --allow-mismatch to "
                             "compare anyway")
    bf16_label, fp8_label = Path(bf16_run).name, Path(fp8_run).name
    out = Path(out_dir) if out_dir is not None else Path(fp8_run)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = out / GATE_PLOT
    plot_gate(result, bf16_label, fp8_label, plot_path)
    table = verdict_table(result, bf16_label, fp8_label)
    if problems:
        table = "\n".join(f"mismatch (allowed): {p}" for p in problems) + "\n" + table
    return result, table, plot_path
