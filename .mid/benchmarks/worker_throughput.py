"""The product's own training loop on one GPU: tokens/s, MFU and peak memory from the worker's metrics.

benchmarks/train_step.py times the training step's work in isolation (bf16 parameters, no data loader, no
checkpoints, no FSDP). This script runs what a user runs - `orchestration.driver.torchrun`, i.e. the worker loop of a
Ray run without Ray (FSDP2 mixed precision with fp32 master weights, the real byte-level data, monitors, guard,
checkpoints, the run directory) - once per variant, in one process tree after another on the same GPU, and reads
each run's metrics.jsonl and events.jsonl:

    python3 benchmarks/worker_throughput.py --out OUT --run-root /tmp/wt \\
        --common model=llama3_8b +model.overrides.n_layers=4 data.seq_len=8192 train.micro_batch_size=1 \\
                 train.global_batch_size=1 train.steps=30 \\
        --variant bf16 precision=bf16 --variant fp8 precision=fp8

A variant whose overrides include `launcher=ray` runs `launch.py` instead (the main command: an embedded Ray
cluster, Ray Train's worker group of one GPU worker), so Ray's overhead is read against a torchrun variant of the
same settings in the same call. Throughput per variant is the median of the metrics lines' tokens_per_s after
--skip-steps (compilation happens in the first steps); ratios are against the first variant. On a prepared corpus
(`data=tokenized`) each variant also reports its held-out eval losses and their relative gap to the first
variant's at the same steps: the quality table (bf16 with two seeds for the noise, then fp8 variants). A variant's run directory is copied to OUT/<name>/
without its checkpoints, which are deleted after the run (an 8B-width checkpoint is tens of GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import env_info, run_own_session


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(run_dir: Path, skip_steps: int) -> dict:
    """What one finished run measured (pure over the run directory's files)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    # the profiled windows: from the first profiled step's start to the event written after the trace
    profiled = [(e["started_time"], e["time"]) for e in events if e["event"] == "profile"]
    steady = [m for m, covered in zip(metrics, times_covered(metrics))
              if m["step"] > skip_steps and m.get("tokens_per_s") and not overlaps(covered, profiled)]

    def median_of(key: str) -> float | None:
        values = [m[key] for m in steady if isinstance(m.get(key), (int, float))]
        return statistics.median(values) if values else None

    peaks = [m["gpu_mem_peak_gib"] for m in metrics if isinstance(m.get("gpu_mem_peak_gib"), (int, float))]
    interesting = ("precision_changed", "rollback", "divergence_detected", "step_skipped", "checkpoint_good",
                   "worker_lost", "resume", "checkpoint_failed", "eval_gap_exceeded")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    def first_time(name: str) -> float | None:
        return next((e["time"] for e in events if e["event"] == name), None)

    t_start, t_group = first_time("run_start"), first_time("worker_group_start")
    return {
        "status": summary.get("status"),
        # run start -> the worker ready to train (process group, data, model built and initialised, resume check)
        "setup_s": round(t_group - t_start, 1) if t_start and t_group else None,
        # run start -> the first metrics line (adds the step-0 checkpoint and compiling)
        "first_metrics_s": round(metrics[0]["time"] - t_start, 1) if metrics and t_start else None,
        "final_step": summary.get("final_step"),
        "tokens_per_s_median": median_of("tokens_per_s"),
        "step_time_s_median": median_of("step_time_s"),
        "mfu_median": median_of("mfu"),
        "steady_log_lines": len(steady),
        "tokens_per_s_lines": [round(m["tokens_per_s"], 1) for m in metrics if m.get("tokens_per_s")],
        "gpu_mem_peak_gib": max(peaks) if peaks else None,
        "losses": [(m["step"], m["loss"]) for m in metrics if "loss" in m],
        # held-out eval (data=tokenized): eval_loss, and on fp8 runs the same weights evaluated in bf16
        "eval_losses": [(m["step"], m["eval_loss"], m.get("eval_loss_bf16")) for m in metrics
                        if isinstance(m.get("eval_loss"), (int, float))],
        "final_eval_loss": summary.get("final_eval_loss"),
        "eval_s_mean": summary.get("eval_s_mean"),
        "checkpoint_seconds": [(e.get("checkpoint_step", e["step"]), e["seconds"]) for e in events
                               if e["event"] == "checkpoint_timing"],
        # where each save's time went (state dicts, DCP write, hashing, finalize)
        "checkpoint_timing": [{k: v for k, v in e.items() if k not in ("time", "event")}
                              for e in events if e["event"] == "checkpoint_timing"],
        # t_s: seconds since the run's start
        "events": [{**{k: v for k, v in e.items() if k != "time"}, "t_s": round(e["time"] - (t_start or 0.0), 2)}
                   for e in events if e["event"] in interesting],
        "recipe": next((e.get("recipe") for e in events if e["event"] == "worker_group_start"), None),
        "restart_recovery": restart_recovery(events, metrics, fault_times(run_dir)),
        "rollback_recovery": rollback_recovery(events, metrics),
        # train.profile_from_step: where the loop's time went in its profiled window (its lines are not in the medians)
        "profile": profile_summaries(run_dir),
    }


def profile_summaries(run_dir: Path) -> list[dict]:
    """The run's profile summaries (profile/*.summary.json: per category, and the longest kernels)."""
    return [json.loads(path.read_text()) for path in sorted((run_dir / "profile").glob("*.summary.json"))]


def times_covered(metrics: list[dict]) -> list[tuple[float, float]]:
    """The wall-clock span (previous line's time, own time] whose tokens each metrics line reports. Pure."""
    out, previous = [], float("-inf")
    for m in metrics:
        out.append((previous, m["time"]))
        previous = m["time"]
    return out


def overlaps(covered: tuple[float, float], windows: list[tuple[float, float]]) -> bool:
    """Whether a line's span (after, until] touches a profiled window [start, end]: the profiled steps and the start
    of the next one, which stopped the profile and wrote its trace. By time, so a rollback or a restart inside the
    window (steps repeated) changes nothing. Pure."""
    return any(covered[1] > start and covered[0] < end for start, end in windows)


def fault_times(run_dir: Path) -> list[float]:
    """When injected process faults fired: the markers' modification times (written and fsynced just before the
    process ends, orchestration/training/faults.py)."""
    return sorted(p.stat().st_mtime for p in (run_dir / "faults").glob("*.fired"))


def restart_recovery(events: list[dict], metrics: list[dict], failures: list[float]) -> list[dict]:
    """Per restart of the worker group (a resume with origin restart), the failure to the first step trained after
    it, split into Ray's share - failure until our new worker process starts (detection, teardown, placement, the
    new process, Ray Train's group setup) - and ours: the worker's setup (process group, data, model), the checkpoint
    load, and the first step (compilation). The failure is the fault's time when injected, else the old group's last
    sign of life. Pure."""
    out = []
    for resume in (e for e in events if e["event"] == "resume" and e.get("origin") == "restart"):
        group = [e for e in events if e["event"] == "worker_group_start" and e.get("worker_rank", 0) == 0
                 and e["time"] <= resume["time"]]
        lost = [e for e in events if e["event"] in ("worker_lost", "workers_added") and e["time"] <= resume["time"]]
        if not group:
            continue
        started = group[-1]["time"]
        worker_start = started - (resume.get("setup_s") or 0.0) - (resume.get("checkpoint_load_s") or 0.0)
        before = [t for t in failures if t <= worker_start]
        failure = before[-1] if before else (lost[-1].get("last_seen_time") if lost else None)
        first = next((m for m in metrics if m.get("time", 0.0) > resume["time"]), None)
        row = {"from_step": resume.get("from_step"), "setup_s": resume.get("setup_s"),
               "checkpoint_load_s": resume.get("checkpoint_load_s"),
               "ray_s": round(worker_start - failure, 2) if failure else None,
               "first_step": first["step"] if first else None,
               "first_step_s": round(first["time"] - started, 2) if first else None,
               "failure_to_first_step_s": round(first["time"] - failure, 2) if first and failure else None}
        out.append(row)
    return out


def rollback_recovery(events: list[dict], metrics: list[dict]) -> list[dict]:
    """Per rollback: the divergence decision to the first step trained after it (checkpoint load, the precision
    switch, recompilation). Pure."""
    out = []
    for rollback in (e for e in events if e["event"] == "rollback" and e.get("worker_rank", 0) == 0):
        detected = [e for e in events if e["event"] == "divergence_detected" and e["time"] <= rollback["time"]]
        first = next((m for m in metrics if m.get("time", 0.0) > rollback["time"]), None)
        start = detected[-1]["time"] if detected else rollback["time"]
        out.append({"from_step": rollback.get("from_step"), "to_step": rollback.get("to_step"),
                    "first_step": first["step"] if first else None,
                    "decision_to_first_step_s": round(first["time"] - start, 2) if first else None})
    return out


def eval_gaps(baseline: list, other: list) -> list[tuple[int, float]]:
    """(step, (other - baseline) / baseline) of the eval losses at the steps both evaluated (pure)."""
    base = {step: loss for step, loss, _ in baseline}
    return [(step, (loss - base[step]) / base[step]) for step, loss, _ in other if step in base]


LAUNCHERS = ("torchrun", "ray")


def launcher_command(launcher: str, overrides: list[str]) -> list[str]:
    """The product's command for one variant: torchrun's one-process launcher, or launch.py through Ray."""
    if launcher == "ray":
        return [sys.executable, "launch.py", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "orchestration.driver.torchrun", *overrides]


def run_variant(name: str, overrides: list[str], args, timeout_s: float) -> dict:
    run_name = f"{name}-{int(time.time())}"
    launcher = "torchrun"
    if overrides and overrides[0].startswith("launcher="):
        launcher = overrides[0].split("=", 1)[1]
        overrides = overrides[1:]
        if launcher not in LAUNCHERS:
            raise SystemExit(f"variant {name}: launcher={launcher} is not one of {', '.join(LAUNCHERS)}")
    cmd = launcher_command(launcher, [*args.common, *overrides, f"run_name={run_name}", f"run_root={args.run_root}"])
    log_path = Path(args.out) / f"{name}.log"
    t0 = time.time()
    rc, wall = run_own_session(cmd, log_path, timeout_s, REPO)
    run_dir = Path(args.run_root) / run_name
    result = {"name": name, "launcher": launcher, "command": " ".join(cmd), "returncode": rc,
              "wall_s": round(wall, 1)}
    if run_dir.exists():
        result.update(summarize_run(run_dir, args.skip_steps))
        run_end = [e["time"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "run_end"]
        # run_end written -> the launcher's process exited (worker teardown, torchrun's agent)
        result["exit_s"] = round(t0 + wall - run_end[-1], 1) if run_end else None
        result["wandb_offline_files"] = sorted(str(p.relative_to(run_dir))
                                               for p in run_dir.glob("wandb/offline-run-*/*.wandb"))
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.copytree(run_dir, Path(args.out) / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("wandb", "*.tmp"))
        shutil.rmtree(run_dir, ignore_errors=True)
    ray_storage = Path(args.run_root) / "_ray" / run_name
    if ray_storage.exists():
        # what Ray Train kept of the run in its storage: checkpoints are not copied there (no second copy)
        result["ray_storage_bytes"] = sum(p.stat().st_size for p in ray_storage.rglob("*") if p.is_file())
        shutil.rmtree(ray_storage, ignore_errors=True)
    return result


def parse_variants(pairs: list[list[str]]) -> list[tuple[str, list[str]]]:
    out = []
    for name, *overrides in pairs:
        out.append((name, overrides))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--run-root", default="/tmp/worker_throughput")
    p.add_argument("--common", nargs="*", default=[], help="Hydra overrides for every variant")
    p.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "OVERRIDE"),
                   help="a name, then that variant's own Hydra overrides (first `launcher=ray` to run it "
                        "through launch.py); repeat per variant; the first is the baseline of the ratios")
    p.add_argument("--skip-steps", type=int, default=10, help="metrics lines up to this step are warm-up")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per variant")
    p.add_argument("--budget-s", type=float, default=None,
                   help="for all variants together: a variant gets at most what is left of it (a run that ends early "
                        "leaves its time to the next: Ray's start makes a variant 30 s longer than torchrun's)")
    p.add_argument("--json-name", default="worker_throughput.json")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = []
    t_start = time.time()
    for name, overrides in parse_variants(args.variant):
        left = args.timeout_s if args.budget_s is None else min(args.timeout_s, args.budget_s - (time.time() - t_start))
        if left < 30:
            print(f"{name:>14}: not run, {left:.0f} s of --budget-s left", flush=True)
            results.append({"name": name, "returncode": "not run: budget spent", "wall_s": 0.0})
            continue
        r = run_variant(name, overrides, args, left)
        results.append(r)
        print(f"{name:>14}: rc={r['returncode']} status={r.get('status')} recipe={r.get('recipe')} "
              f"tok/s={r.get('tokens_per_s_median')} mfu={r.get('mfu_median')} "
              f"peak={r.get('gpu_mem_peak_gib')} GiB ckpt={r.get('checkpoint_seconds')} setup={r.get('setup_s')} s "
              f"first metrics={r.get('first_metrics_s')} s exit={r.get('exit_s')} s wall={r['wall_s']} s",
              flush=True)
        for e in r.get("events", []):
            print(f"{'':>16}{json.dumps(e)[:200]}", flush=True)
        for key in ("restart_recovery", "rollback_recovery", "ray_storage_bytes", "wandb_offline_files"):
            if r.get(key):
                print(f"{'':>16}{key}: {json.dumps(r[key])[:300]}", flush=True)
        for p in r.get("profile", []):
            parts = " ".join(f"{c}={v['ms']}" for c, v in p["breakdown"].items())
            print(f"{'':>16}profile steps {p['steps_seen'][0]}-{p['steps_seen'][-1]} (rank {p['rank']}): "
                  f"{p['wall_ms_per_step']} ms/step = {parts}", flush=True)
    base = results[0].get("tokens_per_s_median")
    for r in results:
        tps = r.get("tokens_per_s_median")
        r["x_baseline"] = tps / base if tps and base else None
        print(f"{r['name']:>14}: {r['x_baseline'] and round(r['x_baseline'], 3)}x {results[0]['name']} tokens/s")
    if results[0].get("eval_losses"):
        for r in results:
            gaps = eval_gaps(results[0]["eval_losses"], r.get("eval_losses") or [])
            r["eval_gap_vs_baseline"] = gaps
            r["eval_gap_final"] = gaps[-1][1] if gaps else None
            print(f"{r['name']:>14}: final eval_loss {r.get('final_eval_loss')}  gap vs {results[0]['name']} "
                  + " ".join(f"{step}:{gap:+.4f}" for step, gap in gaps))
    out = {"env": env_info(), "argv": sys.argv, "skip_steps": args.skip_steps, "results": results}
    (Path(args.out) / args.json_name).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
