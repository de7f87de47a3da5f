"""The report's PNG plots (loss, throughput, precision timeline, world size) and the dry run's scaling plot, drawn on
matplotlib Figure objects (no pyplot, no GUI backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from orchestration.observability.run_data import RunSeries, precision_spans, segments

PRECISION_COLORS = {"fp8": "#2ca02c", "bf16": "#1f77b4"}
OTHER_PRECISION_COLOR = "#bbbbbb"


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
