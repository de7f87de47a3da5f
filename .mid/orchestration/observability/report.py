"""Compare training runs from their run directories alone: PNG plots and a short markdown/HTML summary.

    python -m orchestration.report RUN_DIR [RUN_DIR ...] [--out OUT_DIR]

A RUN_DIR is a directory with metrics.jsonl / events.jsonl (docs/run-directory.md); a directory holding run directories
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
from pathlib import Path
from typing import Any

from orchestration.observability.events import restarts_and_resumes
from orchestration.observability.kernel_profile import KERNEL_CATEGORIES
from orchestration.observability.report_plots import (
    plot_loss,
    plot_precision_timeline,
    plot_scaling,
    plot_throughput,
    plot_world_size,
)
from orchestration.observability.run_data import (
    RunData,
    RunSeries,
    effective_curve,
    expand_run_dirs,
    is_run_dir,
    load_run,
    run_series,
)

PLOTS = ("loss.png", "throughput.png", "precision_timeline.png", "world_size.png")


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
    groups = [e for e in run.events if e.get("event") == "worker_group_start" and e.get("worker_rank", 0) == 0]
    # The recipe the workers resolved (config says "auto" for the device's recommended one), as W&B shows it.
    resolved = next((e["recipe"] for e in reversed(groups) if e.get("recipe")), None)
    recipe = (resolved or _config_field(run.config, "precision", "recipe")) if precision != "bf16" else None
    sizes = sorted(set(series.world_size)) or run.summary.get("world_sizes_seen") or []
    restarts, resumes = restarts_and_resumes(run.events)
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
        "restarts": restarts,
        "resumes": resumes,
        # FP8 emulated on a CPU: its tokens/s measure the emulation, not FP8's speed
        "fp8_emulated": precision == "fp8" and any(e.get("device") == "cpu" for e in groups),
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
            emulated = st["fp8_emulated"] or base_stats["fp8_emulated"]
            parts.append(f"{ratio:.3f}x the median tokens/s"
                         + (" (FP8 emulated on CPU: not a measure of FP8 speed)" if emulated else ""))
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


def profile_table(runs: list[RunData]) -> list[list[str]]:
    """Where each profiled run's step time went (train.profile_from_step: its last `profile` event, rank 0), ms per
    step by category: a header row, then a row per profiled run; [] when no run was profiled."""
    profiled = [(r.label, [e for e in r.events if e.get("event") == "profile"]) for r in runs]
    profiled = [(label, events[-1]) for label, events in profiled if events]
    if not profiled:
        return []
    seen = {c for _, e in profiled for c in e.get("ms_per_step", {})}
    columns = [c for c, _ in KERNEL_CATEGORIES if c in seen] + ["idle"]
    table = [["run", "steps", "wall ms", *columns]]
    for label, e in profiled:
        ms = e.get("ms_per_step", {})
        table.append([label, f"{e['from_step']}-{e['from_step'] + e['steps'] - 1}", f"{e['wall_ms_per_step']:.1f}",
                      *(f"{ms[c]:.1f}" if c in ms else "-" for c in columns)])
    return table


def profile_lines(runs: list[RunData]) -> list[str]:
    """profile_table as markdown lines."""
    return _markdown_table(profile_table(runs))


# ------------------------------------------------------------------------------------------------ summary text

_COLUMNS = [("run", "run"), ("model", "model"), ("precision", "precision"), ("recipe", "recipe"),
            ("status", "status"), ("final_step", "steps"), ("final_loss", "final loss"),
            ("final_eval_loss", "final eval loss"),
            ("median_tokens_per_s", "median tokens/s"), ("mean_mfu", "mean MFU"), ("world_sizes", "world sizes"),
            ("restarts", "restarts"), ("resumes", "resumes"), ("fallbacks", "fallbacks"), ("rollbacks", "rollbacks")]


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


_PROFILE_NOTE = ("Where the time went in the profiled steps (train.profile_from_step), ms per step; traces in each "
                 "run's profile/.")


def _markdown_table(table: list[list[str]]) -> list[str]:
    """A header row and data rows as markdown table lines ("|" inside a cell becomes "/"); [] for no table."""
    if not table:
        return []
    lines = ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in table]
    return [lines[0], "|" + "---|" * len(table[0]), *lines[1:]]


def _html_table(table: list[list[str]]) -> str:
    """A header row and data rows as an HTML table."""
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in table[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table[1:])
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(key: str, st: dict[str, Any]) -> str:
    text = _fmt(key, st.get(key))
    if key == "median_tokens_per_s" and st.get("fp8_emulated") and st.get(key) is not None:
        text += " (emulated FP8)"
    return text


def _stats_table(stats: list[dict[str, Any]]) -> list[list[str]]:
    return [[title for _, title in _COLUMNS], *([_cell(k, st) for k, _ in _COLUMNS] for st in stats)]


def render_markdown(stats: list[dict[str, Any]], comparisons: list[str], profile: list[list[str]] = ()) -> str:
    lines = ["# Run comparison", "", *_markdown_table(_stats_table(stats))]
    if comparisons:
        lines += ["", *(f"- {c}" for c in comparisons)]
    if profile:
        lines += ["", _PROFILE_NOTE, "", *_markdown_table(list(profile))]
    lines += ["", "MFU is against the dense peak of the precision each run used (fp8 peak for FP8 runs).", ""]
    lines += [f"![{p[:-4]}]({p})" for p in PLOTS]
    return "\n".join(lines) + "\n"


def render_html(stats: list[dict[str, Any]], comparisons: list[str], profile: list[list[str]] = ()) -> str:
    items = "".join(f"<li>{html.escape(c)}</li>" for c in comparisons)
    profile_html = f"<p>{html.escape(_PROFILE_NOTE)}</p>{_html_table(list(profile))}" if profile else ""
    imgs = "".join(f'<p><img src="{p}" alt="{p[:-4]}"></p>' for p in PLOTS)
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Run comparison</title>"
            "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>"
            f"<h1>Run comparison</h1>{_html_table(_stats_table(stats))}<ul>{items}</ul>{profile_html}"
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
    profile = profile_table(runs)
    (out_dir / "report.md").write_text(render_markdown(stats, comparisons, profile))
    (out_dir / "report.html").write_text(render_html(stats, comparisons, profile))
    return out_dir / "report.md"


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
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="with --gate: compare even when the runs are not a BF16 and an FP8 run of the same job "
                             "(swapped, an FP8 run that fell back to BF16 before a compared step, other model, data, "
                             "seeds or batch); the differences are printed")
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
        return gate_main(args.gate[0], args.gate[1], args.max_rel_gap, args.out, args.allow_mismatch)
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


def gate_main(bf16_run: Path, fp8_run: Path, max_rel_gap: float, out: Path | None, allow_mismatch: bool = False) -> int:
    from orchestration.observability.quality_gate import run_gate

    try:
        result, table, plot = run_gate(bf16_run, fp8_run, max_rel_gap, out, allow_mismatch)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table)
    print(f"plot: {plot}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
