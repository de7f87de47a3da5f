"""The product on N GPUs of one host: Llama3-8B and DeepSeek-MoE-16B at full depth, bf16 vs FP8, through torchrun and
through Ray, each run with one worker killed mid-run (it must resume from its latest checkpoint and finish).

    python3 benchmarks/multi_gpu.py --gpus 8 --out results/multi_gpu --run-root /tmp/multi_gpu

Each run is `orchestration.driver.torchrun` under `torch.distributed.run --max-restarts=1` (the launcher of machines
that cannot carry Ray) or `launch.py` (Ray Train, elastic), with `faults=kill_worker` on rank 1 at --fault-step
(SIGKILL, as a lost GPU process). What each run measured (benchmarks/worker_throughput.summarize_run: tokens/s median,
MFU, peak memory, checkpoint times) plus the fault's outcome (restarts, the step resumed from, world sizes seen, final
step) goes to OUT/multi_gpu.json with the environment, and each run directory (checkpoints removed) to OUT/<name>/.
Ratios fp8 / bf16 are per launcher and model.

--layouts fsdp hsdp ep hsdp_ep adds HSDP (two replicas of half the GPUs) and expert parallelism (the MoE model's
routed experts over the host's GPUs) to the matrix; the default is plain FSDP.

--debug runs the same matrix at debug sizes on CPU with gloo (debug_dense / debug_moe): the end-to-end check that the
script, both launchers, the fault and the resume work (tests/test_multi_gpu_script.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_own_session
from benchmarks.worker_throughput import read_jsonl, summarize_run

# Full depth, one host. Tokens per GPU a step: Llama3-8B 8192 (torchtitan's seq 8192, batch 1) with activation
# checkpointing: the dry-run plan at 8 GPUs needs 77.8 GiB a GPU without it (56.2 of activations), more than an H100's
# 71 usable, and 29.4 GiB with it (on H200s, `--common model.activation_checkpointing=false` fits); DeepSeek-MoE-16B
# 4096 (seq 4096, batch 1: 60.7 GiB a GPU at 8 GPUs, its fp32 masters, gradients and AdamW states 30.5 of them).
MODELS = {
    "llama3_8b": ["model=llama3_8b", "model.activation_checkpointing=true", "data.seq_len=8192",
                  "train.micro_batch_size=1"],
    "deepseek_moe16b": ["model=deepseek_moe16b", "data.seq_len=4096", "train.micro_batch_size=1"],
}
DEBUG_MODELS = {
    "llama3_8b": ["model=debug_dense", "data.seq_len=64", "train.micro_batch_size=2"],
    "deepseek_moe16b": ["model=debug_moe", "data.seq_len=64", "train.micro_batch_size=2"],
}
LAUNCHERS = ("torchrun", "ray")
PRECISIONS = ("bf16", "fp8")
# Parallel layouts (orchestration/training/elastic.plan_layout): plain FSDP; HSDP with two replicas of half the GPUs
# each; the MoE model's routed experts over all GPUs of the host (at most 8, a divisor of its experts), alone and
# with HSDP. The expert layouts apply to the MoE model only (a dense model has no experts to split).
LAYOUTS = ("fsdp", "hsdp", "ep", "hsdp_ep")


def layout_overrides(layout: str, model: str, gpus: int, debug: bool) -> list[str] | None:
    """The overrides of a layout for a model, or None where it does not apply (expert parallelism, dense model)."""
    experts = 8 if debug else 64  # debug_moe's and DeepSeek-MoE-16B's routed experts
    ep = max(n for n in range(1, min(gpus, 8) + 1) if gpus % n == 0 and experts % n == 0)
    hsdp = ["train.sharding=hsdp", f"train.shard_group_size={max(1, gpus // 2)}"]
    expert = [f"train.expert_parallel={ep}"]
    if layout in ("ep", "hsdp_ep") and model != "deepseek_moe16b":
        return None
    return {"fsdp": [], "hsdp": hsdp, "ep": expert, "hsdp_ep": hsdp + expert}[layout]


def run_overrides(args, model: str, precision: str, run_name: str, layout: str = "fsdp") -> list[str]:
    models = DEBUG_MODELS if args.debug else MODELS
    device = ["cluster.device=cpu", "cluster.cpus_per_worker=1"] if args.debug else [
        "cluster.device=cuda", "cluster.gpus_per_worker=1"]
    micro = int(models[model][-1].split("=")[1])
    return [*models[model], f"precision={precision}", *device, f"train.steps={args.steps}",
            f"train.warmup_steps={min(10, args.steps // 4)}",
            f"train.global_batch_size={micro * args.gpus}", f"checkpoint.every_steps={args.checkpoint_every}",
            "faults=kill_worker", "faults.rank=1", f"faults.step={args.fault_step}", "logging.wandb=false",
            "logging.ray_metrics=false", f"run_name={run_name}", f"run_root={args.run_root}",
            *layout_overrides(layout, model, args.gpus, args.debug), *args.common]


def command(args, launcher: str, overrides: list[str]) -> list[str]:
    if launcher == "torchrun":
        # One restart: the killed rank takes the group down, torchrun starts it again, the loop resumes.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
                "--max-restarts=1", "-m", "orchestration.driver.torchrun", *overrides]
    return [sys.executable, "launch.py", *overrides, f"cluster.min_workers={args.gpus}",
            f"cluster.max_workers={args.gpus}"]


def run_one(args, launcher: str, model: str, precision: str, layout: str = "fsdp") -> dict:
    name = f"{launcher}-{model}-{precision}" + (f"-{layout}" if layout != "fsdp" else "")
    run_name = f"{name}-{int(time.time())}"
    cmd = command(args, launcher, run_overrides(args, model, precision, run_name, layout))
    out = Path(args.out)
    rc, wall = run_own_session(cmd, out / f"{name}.log", args.timeout_s, REPO)
    result = {"name": name, "launcher": launcher, "model": model, "precision": precision, "layout": layout,
              "gpus": args.gpus,
              "command": " ".join(cmd), "returncode": rc, "wall_s": round(wall, 1)}
    run_dir = Path(args.run_root) / run_name
    if run_dir.exists():
        result.update(summarize_run(run_dir, args.skip_steps))
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        events = read_jsonl(run_dir / "events.jsonl")
        result["fault"] = {
            "kind": "kill_worker", "rank": 1, "step": args.fault_step,
            "fired": sorted(p.name for p in run_dir.rglob("fault_kill_worker_*.fired")),
            "resumed_from": [e.get("from_step") for e in events if e["event"] == "resume"],
            "restarts": summary.get("restarts"),
            "world_sizes_seen": summary.get("world_sizes_seen"),
        }
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.copytree(run_dir, out / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("wandb", "*.tmp"))
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def ratios(runs: list[dict]) -> dict:
    """fp8 / bf16 tokens/s median per launcher, model and layout (where both ran)."""
    out = {}
    for r in runs:
        if r["precision"] != "fp8" or not r.get("tokens_per_s_median"):
            continue
        base = next((b for b in runs if b["precision"] == "bf16" and b["launcher"] == r["launcher"]
                     and b["model"] == r["model"] and b.get("layout") == r.get("layout")
                     and b.get("tokens_per_s_median")), None)
        if base:
            key = f"{r['launcher']}-{r['model']}" + (f"-{r['layout']}" if r.get("layout", "fsdp") != "fsdp" else "")
            out[key] = round(r["tokens_per_s_median"] / base["tokens_per_s_median"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, required=True, help="workers (GPUs of this host; CPU processes with --debug)")
    p.add_argument("--out", required=True)
    p.add_argument("--run-root", required=True, help="absolute directory for the runs (moved to --out after)")
    p.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--layouts", nargs="+", default=["fsdp"], choices=LAYOUTS,
                   help="parallel layouts (HSDP, expert parallelism: MoE model only)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fault-step", type=int, default=30)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--skip-steps", type=int, default=8, help="steps left out of the medians (compilation)")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--debug", action="store_true", help="debug sizes on CPU (gloo): the end-to-end check")
    p.add_argument("--common", nargs="*", default=[], help="more Hydra overrides for every run")
    args = p.parse_args(argv)
    if args.gpus < 2:
        p.error("--gpus must be >= 2: the fault kills rank 1")
    if not 0 < args.fault_step < args.steps or args.fault_step <= args.checkpoint_every:
        p.error("--fault-step must come after the first checkpoint (--checkpoint-every) and before --steps")
    if not os.path.isabs(args.run_root):
        p.error("--run-root must be absolute")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from benchmarks.common import env_info

    runs = []
    for launcher in args.launchers:
        for model in args.models:
            for precision in args.precisions:
                for layout in args.layouts:
                    if layout_overrides(layout, model, args.gpus, args.debug) is None:
                        continue
                    runs.append(run_one(args, launcher, model, precision, layout))
                    r = runs[-1]
                    print(f"{r['name']}: rc {r['returncode']}, final step {r.get('final_step')}, tokens/s "
                          f"{r.get('tokens_per_s_median')}, resumed from {r.get('fault', {}).get('resumed_from')}",
                          flush=True)
    result = {"env": env_info(), "gpus": args.gpus, "debug": args.debug, "steps": args.steps,
              "fault_step": args.fault_step, "runs": runs, "fp8_over_bf16": ratios(runs)}
    (Path(args.out) / "multi_gpu.json").write_text(json.dumps(result, indent=2))
    ok = all(r["returncode"] == 0 and r.get("final_step") == args.steps for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
