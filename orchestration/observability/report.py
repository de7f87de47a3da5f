"""Compare training runs from their run directories alone: PNG plots and a short markdown/HTML summary.

    python -m orchestration.report RUN_DIR [RUN_DIR ...] [--out OUT_DIR]

A RUN_DIR is a directory with metrics.jsonl / events.jsonl (DESIGN.md); a directory holding run directories
(a Hydra multirun sweep) stands for all of them. Writes loss.png, throughput.png, precision_timeline.png,
world_size.png, report.md and report.html into OUT_DIR (default: <first run's parent>/report, or <sweep>/report).

Steps can go back: after a rollback to step s, steps s+1.. are logged again. Curves are drawn in logging order,
split where the step goes back, so the abandoned stretch stays visible; comparisons use the effective curve
(for every step, the value logged last).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestration.observability.events import CONFIG_FILE, EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, read_jsonl

PLOTS = ("loss.png", "throughput.png", "precision_timeline.png", "world_size.png")
PRECISION_COLORS = {"fp8": "#2ca02c", "bf16": "#1f77b4"}
OTHER_PRECISION_COLOR = "#bbbbbb"


@dataclass
class RunData:
    """One run directory, read."""

    path: Path
    label: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any]


@dataclass
class RunSeries:
    """What the plots of one run show (x = optimizer step, in logging order; None where not logged)."""

    label: str
    loss_steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)  # held-out evaluations (train.eval_every)
    eval_loss: list[float] = field(default_factory=list)
    throughput_steps: list[int] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    mfu_steps: list[int] = field(default_factory=list)
    mfu: list[float] = field(default_factory=list)
    world_size_steps: list[int] = field(default_factory=list)
    world_size: list[int] = field(default_factory=list)
    precision_steps: list[int] = field(default_factory=list)
    precision: list[str] = field(default_factory=list)
    fallback_steps: list[int] = field(default_factory=list)  # precision_changed to bf16
    recovery_steps: list[int] = field(default_factory=list)  # precision_changed back to fp8
    rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (from_step it happened at, to_step)
    restart_steps: list[int] = field(default_factory=list)  # resume events (failures and resizes)
    worker_lost_steps: list[int] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ reading


def is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).exists() or (path / EVENTS_FILE).exists()


def expand_run_dirs(paths: Sequence[Path]) -> list[Path]:
    """Run directories named, or found one level below a named directory (a sweep); ValueError if none."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ValueError(f"{p} is not a directory; pass run directories (with metrics.jsonl/events.jsonl)")
        if is_run_dir(p):
            found.append(p)
            continue
        children = sorted(c for c in p.iterdir() if c.is_dir() and is_run_dir(c))
        if not children:
            raise ValueError(f"{p} has no {METRICS_FILE} or {EVENTS_FILE}, nor run directories below it")
        found.extend(children)
    return found


def _is_primary(event: dict[str, Any]) -> bool:
    # Agreed decisions are written by every rank, each copy tagged with its writer's worker_rank: keep rank 0's
    # copy (records without worker_rank have one writer). "rank" is something else: the rank that detected.
    return event.get("worker_rank", 0) in (0, None)


def load_run(path: Path, label: str | None = None) -> RunData:
    path = Path(path)
    if not is_run_dir(path):
        raise ValueError(f"{path} is not a run directory (no {METRICS_FILE} or {EVENTS_FILE})")
    config: dict[str, Any] = {}
    if (path / CONFIG_FILE).exists():
        loaded = yaml.safe_load((path / CONFIG_FILE).read_text())
        config = loaded if isinstance(loaded, dict) else {}
    summary: dict[str, Any] = {}
    if (path / SUMMARY_FILE).exists():
        try:
            summary = json.loads((path / SUMMARY_FILE).read_text())
        except json.JSONDecodeError:
            summary = {}
    return RunData(path=path, label=label or path.name, config=config, metrics=read_jsonl(path / METRICS_FILE),
                   events=read_jsonl(path / EVENTS_FILE), summary=summary)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def run_series(run: RunData) -> RunSeries:
    """The data every plot of this run draws, straight from metrics.jsonl and events.jsonl (pure)."""
    s = RunSeries(label=run.label)
    for m in run.metrics:
        step = m.get("step")
        if step is None:
            continue
        if _num(m.get("loss")) is not None:
            s.loss_steps.append(step)
            s.loss.append(m["loss"])
        if _num(m.get("eval_loss")) is not None:
            s.eval_steps.append(step)
            s.eval_loss.append(m["eval_loss"])
        if _num(m.get("tokens_per_s")) is not None:
            s.throughput_steps.append(step)
            s.tokens_per_s.append(m["tokens_per_s"])
        if _num(m.get("mfu")) is not None:
            s.mfu_steps.append(step)
            s.mfu.append(m["mfu"])
        if _num(m.get("world_size")) is not None:
            s.world_size_steps.append(step)
            s.world_size.append(m["world_size"])
        if m.get("precision") is not None:
            s.precision_steps.append(step)
            s.precision.append(str(m["precision"]))
    for e in run.events:
        name, step = e.get("event"), e.get("step")
        if step is None or not _is_primary(e):
            continue
        if name == "precision_changed" and str(e.get("to")).lower() == "bf16":
            s.fallback_steps.append(step)
        elif name == "precision_changed" and str(e.get("to")).lower() == "fp8":
            s.recovery_steps.append(step)
        elif name == "rollback":
            # the worker writes it after restoring (step = to_step) with from_step = where it happened
            s.rollbacks.append((e.get("from_step", step), e.get("to_step")))
        elif name == "resume":
            s.restart_steps.append(step)
        elif name == "worker_lost":
            s.worker_lost_steps.append(step)
    return s


def segments(steps: Sequence[int], values: Sequence[Any]) -> list[tuple[list[int], list[Any]]]:
    """Split a logged series where the step goes back (a rollback or a restart from an older checkpoint)."""
    out: list[tuple[list[int], list[Any]]] = []
    for step, value in zip(steps, values):
        if not out or step <= out[-1][0][-1]:
            out.append(([], []))
        out[-1][0].append(step)
        out[-1][1].append(value)
    return out


def effective_curve(steps: Sequence[int], values: Sequence[Any]) -> dict[int, Any]:
    """step -> the value logged last for it (what the run finally trained on), sorted by step."""
    last: dict[int, Any] = {}
    for step, value in zip(steps, values):
        last[step] = value
    return dict(sorted(last.items()))


def precision_spans(steps: Sequence[int], precision: Sequence[str]) -> list[tuple[int, int, str]]:
    """(start step, end step, precision) of the effective precision timeline (pure).

    Uses the effective curve (after a rollback the re-run steps count, the abandoned ones do not); each logged
    precision holds until the next logged step, so spans touch without gaps.
    """
    curve = effective_curve(steps, precision)
    points = list(curve.items())
    spans: list[tuple[int, int, str]] = []
    for i, (step, prec) in enumerate(points):
        end = points[i + 1][0] if i + 1 < len(points) else step
        if spans and spans[-1][2] == prec:
            spans[-1] = (spans[-1][0], end, prec)
        else:
            spans.append((step, end, prec))
    return spans


# ------------------------------------------------------------------------------------------------ numbers


def _config_field(config: dict[str, Any], group: str, key: str = "name") -> str | None:
    value = config.get(group)
    if isinstance(value, dict):
        value = value.get(key)
    return None if value is None else str(value)


def run_stats(run: RunData, series: RunSeries) -> dict[str, Any]:
    """One row of the summary table."""
    loss = effective_curve(series.loss_steps, series.loss)
    evals = effective_curve(series.eval_steps, series.eval_loss)
    finite_tps = [t for t in series.tokens_per_s if math.isfinite(t)]
    precision = _config_field(run.config, "precision") or (series.precision[0] if series.precision else None)
    recipe = _config_field(run.config, "precision", "recipe") if precision != "bf16" else None
    sizes = sorted(set(series.world_size)) or run.summary.get("world_sizes_seen") or []
    return {
        "run": run.label,
        "model": _config_field(run.config, "model"),
        "precision": precision,
        "recipe": recipe,
        "status": run.summary.get("status") or _last_status(run.events),
        "final_step": max(loss) if loss else run.summary.get("final_step"),
        "final_loss": loss[max(loss)] if loss else run.summary.get("final_loss"),
        "final_eval_loss": evals[max(evals)] if evals else run.summary.get("final_eval_loss"),
        "median_tokens_per_s": statistics.median(finite_tps) if finite_tps else None,
        "mean_mfu": statistics.fmean(series.mfu) if series.mfu else None,
        "world_sizes": sizes,
        "restarts": len(series.restart_steps),
        "fallbacks": len(series.fallback_steps),
        "rollbacks": len(series.rollbacks),
    }


def _last_status(events: list[dict[str, Any]]) -> str | None:
    ends = [e.get("status") for e in events if e.get("event") == "run_end"]
    return ends[-1] if ends else None


def comparison_lines(runs: list[RunData], series: list[RunSeries], stats: list[dict[str, Any]]) -> list[str]:
    """Each run against the first: throughput ratio, and loss at the last step both reached."""
    if len(runs) < 2:
        return []
    base, base_stats = series[0], stats[0]
    base_loss = effective_curve(base.loss_steps, base.loss)
    lines = []
    for s, st in zip(series[1:], stats[1:]):
        parts = []
        if base_stats["median_tokens_per_s"] and st["median_tokens_per_s"]:
            ratio = st["median_tokens_per_s"] / base_stats["median_tokens_per_s"]
            parts.append(f"{ratio:.3f}x the median tokens/s")
        loss = effective_curve(s.loss_steps, s.loss)
        common = sorted(set(loss) & set(base_loss))
        if common:
            step = common[-1]
            a, b = base_loss[step], loss[step]
            if math.isfinite(a) and math.isfinite(b) and a != 0:
                parts.append(f"loss at step {step} {b:.4f} vs {a:.4f} ({100 * (b - a) / abs(a):+.2f}%)")
        if parts:
            lines.append(f"{s.label} vs {base.label}: " + "; ".join(parts))
    return lines


# ------------------------------------------------------------------------------------------------ plots


def _figure(nrows: int = 1, height: float = 4.0):
    from matplotlib.figure import Figure  # Figure objects need no pyplot and no GUI backend (Agg canvas)

    fig = Figure(figsize=(9, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, 1, squeeze=False)[:, 0]
    return fig, axes


def _color(i: int) -> str:
    return f"C{i % 10}"


def _mark_events(ax, s: RunSeries, color: str) -> None:
    for step in s.fallback_steps:
        ax.axvline(step, color=color, linestyle="--", linewidth=1, alpha=0.8)
    for step, _ in s.rollbacks:
        ax.axvline(step, color=color, linestyle=":", linewidth=1.5, alpha=0.9)


def plot_loss(series: list[RunSeries], path: Path):
    fig, (ax,) = _figure()
    for i, s in enumerate(series):
        for j, (x, y) in enumerate(segments(s.loss_steps, s.loss)):
            ax.plot(x, y, color=_color(i), linewidth=1.2, label=s.label if j == 0 else None, gid=f"data:{s.label}")
        for j, (x, y) in enumerate(segments(s.eval_steps, s.eval_loss)):
            ax.plot(x, y, color=_color(i), linewidth=1.2, linestyle="--", marker="o", markersize=3,
                    label=f"{s.label} (held-out eval)" if j == 0 else None, gid=f"eval:{s.label}")
        _mark_events(ax, s, _color(i))
    finite = sorted(v for s in series for v in s.loss if math.isfinite(v) and v > 0)
    if finite and finite[-1] > 4 * finite[len(finite) // 2]:
        ax.set_yscale("log")  # a spike (the thing to look at) would flatten the rest of the curve
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Training loss, held-out eval loss (o--) (vertical dashed: FP8->BF16 fallback, dotted: rollback)")
    ax.grid(alpha=0.3)
    if series:
        ax.legend()
    fig.savefig(path, dpi=100)
    return fig


def plot_throughput(series: list[RunSeries], path: Path):
    with_mfu = any(s.mfu for s in series)
    fig, axes = _figure(2 if with_mfu else 1, height=3.5)
    for i, s in enumerate(series):
        for j, (x, y) in enumerate(segments(s.throughput_steps, s.tokens_per_s)):
            axes[0].plot(x, y, color=_color(i), linewidth=1.2, label=s.label if j == 0 else None,
                         gid=f"data:{s.label}")
        _mark_events(axes[0], s, _color(i))
        if with_mfu:
            for j, (x, y) in enumerate(segments(s.mfu_steps, s.mfu)):
                axes[1].plot(x, [100 * v for v in y], color=_color(i), linewidth=1.2,
                             label=s.label if j == 0 else None, gid=f"data:{s.label}")
    axes[0].set_ylabel("tokens/s (all workers)")
    axes[0].set_title("Throughput")
    if with_mfu:
        axes[1].set_ylabel("MFU (%)")
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        if series:
            ax.legend()
    fig.savefig(path, dpi=100)
    return fig


def plot_scaling(scaling: dict[str, Any], path: Path):
    """Predicted tokens/s per GPU, MFU and scaling efficiency against GPUs, one line per precision: the "scaling"
    section of a dry-run plan (cluster.fabric set; orchestration.driver.plan.scaling_plan)."""
    fig, axes = _figure(3, height=3.0)
    for i, (label, rows) in enumerate(scaling["curves"].items()):
        gpus = [r["world_size"] for r in rows]
        for ax, key, scale in ((axes[0], "tokens_per_s_per_gpu", 1.0), (axes[1], "mfu", 100.0),
                               (axes[2], "scaling_efficiency", 100.0)):
            ax.plot(gpus, [scale * r[key] for r in rows], marker="o", color=_color(i), label=label, gid=f"data:{label}")
    axes[0].set_title(f"Predicted scaling on {scaling['fabric']} ({scaling['tokens_per_gpu']:,} tokens per GPU a step)")
    for ax, ylabel in zip(axes, ("tokens/s per GPU", "MFU (% of bf16 peak)", "scaling efficiency (% of 1 GPU)")):
        ax.set_xscale("log", base=2)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1].set_xlabel("GPUs")
    fig.savefig(path, dpi=100)
    return fig


def read_plan(path: Path) -> dict[str, Any]:
    """The plan JSON of a dry run: a file holding it, or the dry run's output (its line starting with "PLAN ")."""
    text = path.read_text()
    for line in text.splitlines():
        if line.startswith("PLAN "):
            return json.loads(line[len("PLAN "):])
    return json.loads(text)


def scaling_main(plan_path: Path, out: Path | None) -> int:
    plan = read_plan(plan_path)
    if not plan.get("scaling"):
        print(f"error: {plan_path} has no scaling prediction: run the dry run with cluster.fabric=<preset>",
              file=sys.stderr)
        return 2
    out = out or plan_path.resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scaling.png"
    plot_scaling(plan["scaling"], path)
    print(f"plot: {path}")
    return 0


def plot_precision_timeline(series: list[RunSeries], path: Path):
    fig, (ax,) = _figure(height=max(2.0, 0.8 * len(series) + 1.2))
    for i, s in enumerate(series):
        y = len(series) - 1 - i
        for start, end, precision in precision_spans(s.precision_steps, s.precision):
            ax.broken_barh([(start, max(end - start, 0.5))], (y - 0.3, 0.6),
                           facecolors=PRECISION_COLORS.get(precision.lower(), OTHER_PRECISION_COLOR), alpha=0.8)
        for step in s.fallback_steps:
            ax.plot(step, y + 0.38, marker="v", color="#d62728", markersize=9)
        for step in s.recovery_steps:
            ax.plot(step, y + 0.38, marker="^", color="#2ca02c", markersize=9)
        for step, to_step in s.rollbacks:
            ax.annotate("", xy=(to_step if to_step is not None else step, y - 0.38), xytext=(step, y - 0.38),
                        arrowprops={"arrowstyle": "->", "color": "#000000"})
            ax.plot(step, y - 0.38, marker="|", color="#000000", markersize=10)
        for step in s.restart_steps:
            ax.plot(step, y, marker="o", color="#ff7f0e", markersize=5)
    ax.set_yticks(range(len(series)), [s.label for s in reversed(series)])
    ax.set_ylim(-0.7, len(series) - 0.3)
    ax.set_xlabel("step")
    ax.set_title("Precision (green fp8, blue bf16); red v fallback, green ^ back to fp8, "
                 "arrow rollback, orange o restart", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=100)
    return fig


def plot_world_size(series: list[RunSeries], path: Path):
    fig, (ax,) = _figure(height=3.0)
    for i, s in enumerate(series):
        for j, (x, y) in enumerate(segments(s.world_size_steps, s.world_size)):
            # later runs thinner, so a run hidden under another's equal world size still shows
            ax.step(x, y, where="post", color=_color(i), linewidth=max(1.0, 3.5 - i), alpha=0.85,
                    label=s.label if j == 0 else None, gid=f"data:{s.label}")
        for step in s.worker_lost_steps:
            ax.axvline(step, color=_color(i), linestyle="--", linewidth=1, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("workers")
    ax.set_title("World size (dashed: worker lost)")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if series:
        ax.legend()
    fig.savefig(path, dpi=100)
    return fig


# ------------------------------------------------------------------------------------------------ summary text

_COLUMNS = [("run", "run"), ("model", "model"), ("precision", "precision"), ("recipe", "recipe"),
            ("status", "status"), ("final_step", "steps"), ("final_loss", "final loss"),
            ("final_eval_loss", "final eval loss"),
            ("median_tokens_per_s", "median tokens/s"), ("mean_mfu", "mean MFU"), ("world_sizes", "world sizes"),
            ("restarts", "restarts"), ("fallbacks", "fallbacks"), ("rollbacks", "rollbacks")]


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "mean_mfu":
        return f"{100 * value:.1f}%"
    if key in ("final_loss", "final_eval_loss"):
        return f"{value:.4f}"
    if key == "median_tokens_per_s":
        return f"{value:,.0f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(value)


def render_markdown(stats: list[dict[str, Any]], comparisons: list[str]) -> str:
    lines = ["# Run comparison", "",
             "| " + " | ".join(title for _, title in _COLUMNS) + " |",
             "|" + "---|" * len(_COLUMNS)]
    for st in stats:
        lines.append("| " + " | ".join(_fmt(k, st.get(k)).replace("|", "/") for k, _ in _COLUMNS) + " |")
    if comparisons:
        lines += ["", *(f"- {c}" for c in comparisons)]
    lines += ["", "MFU is against the dense peak of the precision each run used (fp8 peak for FP8 runs).", ""]
    lines += [f"![{p[:-4]}]({p})" for p in PLOTS]
    return "\n".join(lines) + "\n"


def render_html(stats: list[dict[str, Any]], comparisons: list[str]) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in _COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(k, st.get(k)))}</td>" for k, _ in _COLUMNS) + "</tr>"
                   for st in stats)
    items = "".join(f"<li>{html.escape(c)}</li>" for c in comparisons)
    imgs = "".join(f'<p><img src="{p}" alt="{p[:-4]}"></p>' for p in PLOTS)
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Run comparison</title>"
            "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>"
            f"<h1>Run comparison</h1><table><tr>{head}</tr>{rows}</table><ul>{items}</ul>"
            "<p>MFU is against the dense peak of the precision each run used (fp8 peak for FP8 runs).</p>"
            f"{imgs}</body></html>\n")


# ------------------------------------------------------------------------------------------------ entry points


def _labels(paths: list[Path]) -> list[str]:
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{p.parent.name}/{p.name}" for p in paths]


def build_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """Write the four PNGs and report.md / report.html into out_dir; returns the report.md path."""
    paths = expand_run_dirs(run_dirs)
    runs = [load_run(p, label) for p, label in zip(paths, _labels(paths))]
    series = [run_series(r) for r in runs]
    stats = [run_stats(r, s) for r, s in zip(runs, series)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_loss(series, out_dir / "loss.png")
    plot_throughput(series, out_dir / "throughput.png")
    plot_precision_timeline(series, out_dir / "precision_timeline.png")
    plot_world_size(series, out_dir / "world_size.png")
    comparisons = comparison_lines(runs, series, stats)
    (out_dir / "report.md").write_text(render_markdown(stats, comparisons))
    (out_dir / "report.html").write_text(render_html(stats, comparisons))
    return out_dir / "report.md"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestration.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="*", type=Path, help="run directories (or a sweep directory of them)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: <first run directory's parent>/report, or <sweep dir>/report; "
                             "with --gate: the FP8 run directory)")
    parser.add_argument("--gate", nargs=2, type=Path, metavar=("BF16_RUN", "FP8_RUN"),
                        help="FP8 quality gate instead of the report: held-out eval loss of FP8_RUN against BF16_RUN at "
                             "matching steps; exit 1 when a gap exceeds --max-rel-gap (orchestration/observability/"
                             "quality_gate.py)")
    parser.add_argument("--max-rel-gap", type=float, default=0.01,
                        help="largest (eval_fp8 - eval_bf16) / eval_bf16 the gate accepts (default 0.01)")
    parser.add_argument("--scaling", type=Path, metavar="PLAN",
                        help="plot the scaling prediction of a dry run's plan (its output or PLAN json; dry_run=true "
                             "cluster.fabric=<preset>) into --out/scaling.png instead of the report")
    args = parser.parse_args(argv)
    if args.scaling:
        return scaling_main(args.scaling, args.out)
    if args.gate:
        if args.run_dirs:
            parser.error("--gate takes its two run directories itself; drop the other run directories")
        return gate_main(args.gate[0], args.gate[1], args.max_rel_gap, args.out)
    if not args.run_dirs:
        parser.error("give run directories to report on (or --gate BF16_RUN FP8_RUN)")
    first = args.run_dirs[0].resolve()
    out = args.out or (first.parent / "report" if is_run_dir(first) else first / "report")
    try:
        report = build_report(args.run_dirs, out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.read_text())
    print(f"report: {report} (+ report.html, {', '.join(PLOTS)}) in {out}")
    return 0


def gate_main(bf16_run: Path, fp8_run: Path, max_rel_gap: float, out: Path | None) -> int:
    from orchestration.observability.quality_gate import run_gate

    try:
        result, table, plot = run_gate(bf16_run, fp8_run, max_rel_gap, out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table)
    print(f"plot: {plot}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
