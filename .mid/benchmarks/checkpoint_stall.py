"""Training stall per checkpoint save under Ray Train: our save, then the report to Ray, with Ray copying the
directory into its storage (Ray's default, the loop's behaviour before) and without (what the loop does now with a
local or shared storage path, orchestration/training/ray_report.py).

    python benchmarks/checkpoint_stall.py                         # CPU: 256 MiB state, 4 saves per mode
    python benchmarks/checkpoint_stall.py --size-mib 8192 --gpu   # a GPU worker, state on the GPU

One Ray Train worker on an embedded cluster saves a state of --size-mib MiB (fp32 tensors of 64 MiB, model and
optimizer-like) with the product's CheckpointManager, synchronously, --saves times per mode, and reports each save
to Ray as the mode says. Per save: save_s (our write, hash, manifest), report_s (ray.train.report: Ray's copy when
it uploads) and stall_s, their sum, the time training stands still; after each mode the bytes Ray's storage holds.
Writes benchmarks/results/checkpoint_stall.json (benchmarks.common.write_result).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("ray_copy", "report_without_copy")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def train_fn(config: dict) -> None:
    """The Ray Train worker: build the state, save and report --saves times in the given mode."""
    import json

    import ray.train
    import torch

    from orchestration.checkpoint.directory import ray_checkpoint_dir
    from orchestration.checkpoint.manager import CheckpointManager
    from orchestration.training.ray_report import report_checkpoint

    device = torch.device("cuda" if config["gpu"] else "cpu")
    tensor_mib = 64
    count = max(1, config["size_mib"] // tensor_mib)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(tensor_mib << 18, device=device))
                                    for _ in range(count)])
    manager = CheckpointManager(config["checkpoints"], keep_last=2, keep_good=1, rank=0, world_size=1)
    rows = []
    for index in range(config["saves"]):
        step = index + 1
        t0 = time.perf_counter()
        path = manager.save(step, model, None, None, {"step": step}, stage=config["gpu"])
        t1 = time.perf_counter()
        if config["mode"] == "ray_copy":
            ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(ray_checkpoint_dir(path)))
        else:
            report_checkpoint({"step": step}, path, rank=0, upload=False)
        t2 = time.perf_counter()
        rows.append({"step": step, "save_s": round(t1 - t0, 3), "report_s": round(t2 - t1, 3),
                     "stall_s": round(t2 - t0, 3)})
    Path(config["rows_file"]).write_text(json.dumps(rows))


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict:
    import json

    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    storage = work / f"ray_storage_{mode}"
    rows_file = work / f"rows_{mode}.json"
    config = {"mode": mode, "size_mib": args.size_mib, "saves": args.saves, "gpu": args.gpu,
              "checkpoints": str(work / f"run_{mode}" / "checkpoints"), "rows_file": str(rows_file)}
    resources = {"CPU": 1, **({"GPU": 1} if args.gpu else {})}
    trainer = TorchTrainer(train_fn, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=1, use_gpu=args.gpu,
                                                        resources_per_worker=resources),
                           torch_config=TorchConfig(backend="nccl" if args.gpu else "gloo"),
                           run_config=RunConfig(name=f"stall_{mode}", storage_path=str(storage),
                                                checkpoint_config=CheckpointConfig(num_to_keep=2)))
    trainer.fit()
    rows = json.loads(rows_file.read_text())
    checkpoint_bytes = tree_bytes(work / f"run_{mode}" / "checkpoints" / f"step_{args.saves:06d}")
    # The first save allocates and warms up; the median of the later ones is the steady stall.
    steady = rows[1:] or rows
    return {"mode": mode, "saves": rows, "checkpoint_bytes": checkpoint_bytes,
            "ray_storage_bytes": tree_bytes(storage),
            "median_save_s": statistics.median(r["save_s"] for r in steady),
            "median_report_s": statistics.median(r["report_s"] for r in steady),
            "median_stall_s": statistics.median(r["stall_s"] for r in steady)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="state size in MiB (64 MiB tensors)")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--health-check-interval-s", type=float, default=0.2,
                   help="Ray Train's result polling interval (cluster.health_check_interval_s: 0.2 local, 1.0 on the "
                        "cloud presets); a report waits for the controller to take the previous one")
    p.add_argument("--gpu", action="store_true", help="a GPU worker with its state on the GPU")
    p.add_argument("--work-dir", default=None, help="where the checkpoints and Ray's storage go (default: a temp "
                                                    "directory on the same disk as /tmp, removed at the end)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint_stall.json"))
    args = p.parse_args()

    import ray

    from benchmarks.common import write_result

    t_start = time.time()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="checkpoint_stall_"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # As the product's driver sets it (orchestration.driver.ray_job.driver_env): read by the controller.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.health_check_interval_s)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO),
                                       "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(args.health_check_interval_s)}})
    try:
        results = [run_mode(mode, args, work) for mode in MODES]
    finally:
        ray.shutdown()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    for r in results:
        print(f"{r['mode']:<22} stall/save {r['median_stall_s']:7.3f} s  (save {r['median_save_s']:.3f} s, "
              f"report {r['median_report_s']:.3f} s)  Ray storage {r['ray_storage_bytes'] / 2**20:8.1f} MiB  "
              f"checkpoint {r['checkpoint_bytes'] / 2**20:8.1f} MiB", flush=True)
    command = " ".join(["python", "benchmarks/checkpoint_stall.py", *sys.argv[1:]])
    write_result(args.out, benchmark="checkpoint_stall", suite="checkpoint", command=command,
                 suite_command=command, returncode=0, wall_s=time.time() - t_start,
                 results={"size_mib": args.size_mib, "saves": args.saves, "gpu": args.gpu,
                          "health_check_interval_s": args.health_check_interval_s, "modes": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
