"""Run a named benchmark suite and write one current JSON per benchmark to benchmarks/results/<name>.json.

    python3 benchmarks/run_suite.py dense|moe|kernels|loop|checkpoint|quality_dense|\
        quality_moe|quality_moe_seeds|ray_dense|ray_faults|mission|all [--only NAME ...] [--dry-run]
    make bench-gpu SUITE=dense                       # the same through make (BENCH_ARGS passes more options)

Each benchmark program runs in its own process, one after another on the same GPU (ratios are read inside one
file, never across files or machines). Its own JSON output is wrapped by benchmarks.common.write_result with the
command, the GPU, the torch/triton/torchao versions and the date, and replaces the previous file of that name:
history lives in git. A benchmark that fails or times out still gets its file, with the return code and the end
of its output, so a partial suite says what is missing.

The GPU image has torch and triton but not hydra-core/omegaconf (the training step and the product loop compose
the job config through them) nor torchao (the comparison rows). What a suite needs and the image lacks is
installed from the wheels in --wheels (default .whl/, ignored by git; `make bench-wheels` downloads them on a
machine with network) into --site, put first on PYTHONPATH of every benchmark. A missing required module stops the
run before any benchmark starts; a missing torchao only drops torchao's rows (each program records why).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

log = logging.getLogger("run_suite")

# Modules the GPU image lacks, with the pip distribution that provides each (what --wheels must hold).
DISTRIBUTIONS = {
    "hydra": "hydra-core==1.3.8",
    "omegaconf": "omegaconf==2.3.1",
    "antlr4": "antlr4-python3-runtime==4.9.3",
    "torchao": "torchao==0.18.0",
}
CONFIG_MODULES = ("hydra", "omegaconf", "antlr4")  # orchestration's config: the training step and the product loop

# The product loop's settings shared by its runs: one GPU worker, no W&B, metrics every 2 steps, and the lr of the
# recorded figures (3e-4) for both models, so a new run compares with the tables in BENCHMARKS.md.
LOOP_COMMON = ("cluster.device=cuda", "cluster.min_workers=1", "cluster.max_workers=1", "cluster.gpus_per_worker=1",
               "logging.wandb=false", "train.lr=3e-4", "train.warmup_steps=5", "train.log_every=2")
MOE_LOOP = ("model=deepseek_moe16b", "data.seq_len=4096", "train.micro_batch_size=4", "train.global_batch_size=4")
DENSE_LOOP = ("model=llama3_8b", "+model.overrides.n_layers=4", "data.seq_len=8192", "train.micro_batch_size=1",
              "train.global_batch_size=1")


@dataclass(frozen=True)
class Benchmark:
    """One program run: `python3 benchmarks/<script> <args> --out DIR` writes the JSON file `output` into DIR."""

    name: str  # benchmarks/results/<name>.json
    script: str
    args: tuple[str, ...]
    output: str  # the JSON file the program writes into its --out directory
    requires: tuple[str, ...] = ()  # modules it cannot run without
    optional: tuple[str, ...] = ()  # modules whose absence only drops rows
    timeout_s: int = 600
    run_root: bool = False  # takes --run-root (the product loop's run directories)

    def command(self, out_dir: Path, run_root: Path | None = None) -> list[str]:
        cmd = [sys.executable, str(Path("benchmarks") / self.script), *self.args, "--out", str(out_dir)]
        if self.run_root:
            cmd += ["--run-root", str(run_root)]
        return cmd


def _loop(name: str, model: tuple[str, ...], steps: int, variants: tuple[tuple[str, ...], ...], timeout_s: int,
          extra: tuple[str, ...] = (), common: tuple[str, ...] = LOOP_COMMON) -> Benchmark:
    # The variants share one budget, each at most 200 s when there are several: a Ray variant starts ~35 s later
    # than a torchrun one.
    budget_s = timeout_s - 15
    per_variant_s = min(200, budget_s) if len(variants) > 1 else budget_s
    args = ("--json-name", f"{name}.json", "--skip-steps", "8", "--timeout-s", str(per_variant_s),
            "--budget-s", str(budget_s),
            "--common", *model, *common, f"train.steps={steps}", *extra)
    for variant in variants:
        args += ("--variant", *variant)
    return Benchmark(name, "worker_throughput.py", args, f"{name}.json", requires=CONFIG_MODULES,
                     timeout_s=timeout_s, run_root=True)


QUALITY_COMMON = ("data=tokenized", "data.seq_len=2048", "data.eval_sequences=64", "+model.overrides.vocab_size=32768",
                  "cluster.device=cuda", "cluster.min_workers=1", "cluster.max_workers=1", "cluster.gpus_per_worker=1",
                  "logging.wandb=false", "train.steps=300", "train.warmup_steps=30", "train.eval_every=50",
                  "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=10",
                  "checkpoint.every_steps=0", "monitor.eval_gap_max=1.0")  # the gap is measured, not acted on
RAY_ONE_GPU = ("cluster.cpus_per_worker=4", "cluster.memory_per_worker_gb=64")
# Fault runs: every step logged (the recovery's first step), a checkpoint every 8 steps, the last one kept, W&B
# offline (one W&B run across the restart).
RAY_FAULT_COMMON = tuple(o for o in LOOP_COMMON if not o.startswith(("logging.wandb", "train.log_every"))) + (
    "train.log_every=1", "precision=fp8", "checkpoint.every_steps=8", "checkpoint.keep_last=1", "logging.wandb=true",
    "logging.wandb_mode=offline")
QUALITY_CORPUS = REPO / "corpora" / "stdlib_docs_32k"


def _quality(name: str, model: tuple[str, ...], variants: tuple[tuple[str, ...], ...], timeout_s: int) -> Benchmark:
    # A 300-step run took 74-98 s through torchrun and 104-108 s through Ray on an H100 (an fp8 run compiling first
    # under Ray needed more than 130 s): each variant may take 150 s of one shared budget.
    args = ("--json-name", f"{name}.json", "--skip-steps", "20", "--timeout-s", "150", "--budget-s", str(timeout_s - 15),
            "--common", *model, *QUALITY_COMMON, f"data.path={QUALITY_CORPUS}")
    for variant in variants:
        args += ("--variant", *variant)
    return Benchmark(name, "worker_throughput.py", args, f"{name}.json", requires=CONFIG_MODULES,
                     timeout_s=timeout_s, run_root=True)


# Each suite fits one 10-minute device call; their order inside a suite is the order they run in.
SUITES: dict[str, tuple[Benchmark, ...]] = {
    "kernels": (
        Benchmark("fp8_kernels", "fp8_kernels.py", ("--budget-s", "150"), "fp8_kernels.json", timeout_s=240),
        Benchmark("ce_head", "ce_head.py", (), "ce_head.json", timeout_s=150),
        Benchmark("tile_sweeps", "tile_sweeps.py", (), "tile_sweeps.json", timeout_s=120),
        Benchmark("adamw", "adamw.py", ("--models", "llama3_8b:8", "deepseek_moe16b:4", "--blocks", "512",
                                        "--warps", "4", "--hints", "pointer"), "adamw.json", timeout_s=90),
    ),
    "dense": (
        Benchmark("fp8_linear", "fp8_linear.py", ("--impls", "bf16", "torchao", "ours_compiled", "--prewarm", "12",
                                                  "--budget-s", "200"), "fp8_linear.json",
                  optional=("torchao",), timeout_s=270),
        Benchmark("train_step_dense", "train_step.py",
                  ("--configs", "dense", "--only",
                   "bf16,ours_head:tensorwise,torchao_head:tensorwise",
                   "--steps", "8", "--warmup", "3", "--budget-s", "200", "--profile"), "train_step.json",
                  requires=CONFIG_MODULES, optional=("torchao",), timeout_s=270),
    ),
    # The product's step (the FP8 head is its default) against torchao with the same head setting on both sides
    # (torchao's MoE conversion has no head: ours:tensorwise is its twin); variants in priority order, each profiled.
    "moe": (
        Benchmark("moe_grouped", "moe_grouped.py", ("--cases", "bf16_compiled", "ours_compiled", "torchao_compiled",
                                                    "--budget-s", "150"), "moe_grouped.json",
                  optional=("torchao",), timeout_s=210),
        Benchmark("train_step_moe", "train_step.py",
                  ("--configs", "moe", "--only",
                   "bf16,ours_head:tensorwise,ours:tensorwise,torchao:moe",
                   "--steps", "12", "--warmup", "3", "--budget-s", "270", "--profile"), "train_step.json",
                  requires=CONFIG_MODULES, optional=("torchao",), timeout_s=340),
    ),
    # No checkpoints in the throughput and quality runs (checkpoint.every_steps=0): a 4-layer MoE-width save is
    # ~30 GB, and the step-0 and final saves of two of them do not fit the GPU machine's 64 GiB disk; the
    # checkpoint suite measures saves.
    # The product loop with no flags (precision=fp8 is the FP8 head too) against bf16, and FP8 with a bf16 head; each
    # run profiles 3 steps late in the run (train.profile_from_step: where the loop's time goes, left out of its
    # tokens/s).
    "loop": (
        _loop("loop_dense", DENSE_LOOP, 30, (("bf16", "precision=bf16"), ("fp8", "precision=fp8"),
                                             ("fp8_bf16_head", "precision=fp8", "precision.fp8_output_head=false")),
              timeout_s=300, extra=("checkpoint.every_steps=0", "train.profile_from_step=20")),
        _loop("loop_moe", MOE_LOOP + ("+model.overrides.n_layers=4",), 24,
              (("bf16", "precision=bf16"), ("fp8", "precision=fp8"),
               ("fp8_bf16_head", "precision=fp8", "precision.fp8_output_head=false")),
              timeout_s=290, extra=("checkpoint.every_steps=0", "train.profile_from_step=12")),
    ),
    # The main command (launch.py, Ray Train, one GPU worker): its throughput against the torchrun loop of the same
    # settings in the same call (dense), and faults through Ray on the product's MoE (2 layers: a save is ~13 GB,
    # keep_last=1 keeps two on the 64 GiB disk at most): the crash's restart and the loss spike's fallback and
    # rollback, with their recovery split (Ray's share, ours), the stall per save and what Ray's storage kept.
    "ray_dense": (
        _loop("ray_dense", DENSE_LOOP, 30, (("fp8_torchrun", "precision=fp8"),
                                            ("fp8", "launcher=ray", *RAY_ONE_GPU, "precision=fp8"),
                                            ("bf16_torchrun", "precision=bf16"),
                                            ("bf16", "launcher=ray", *RAY_ONE_GPU, "precision=bf16")),
              timeout_s=420, extra=("checkpoint.every_steps=0",)),
    ),
    # The mission command as a new user types it on one GPU: launch.py through Ray with no cluster, data or train
    # flags (the machine and the model decide the shape), bf16 against fp8, then the same pair at seq 128. No W&B
    # (not in the GPU image) and no checkpoints (a 4-layer MoE-width save is ~30 GB; the disk holds two).
    "mission": (
        _loop("mission_moe", ("model=deepseek_moe16b", "+model.overrides.n_layers=4"), 120,
              (("bf16", "launcher=ray", "precision=bf16"), ("fp8", "launcher=ray", "precision=fp8"),
               ("bf16_seq128", "launcher=ray", "precision=bf16", "data.seq_len=128"),
               ("fp8_seq128", "launcher=ray", "precision=fp8", "data.seq_len=128")),
              timeout_s=590, common=("logging.wandb=false", "checkpoint.every_steps=0")),
    ),
    "ray_faults": (
        _loop("ray_crash", MOE_LOOP + ("+model.overrides.n_layers=2",), 16,
              (("crash", "launcher=ray", *RAY_ONE_GPU, "faults=crash", "faults.rank=0", "faults.step=11"),),
              timeout_s=270, common=RAY_FAULT_COMMON),
        # The monitors watch from step 8 (default 20) and a save is good 2 steps later (default 20), so the spike
        # at steps 12-14 (skip, BF16 fallback, rollback) rolls back to step 8 within 16 steps.
        _loop("ray_loss_spike", MOE_LOOP + ("+model.overrides.n_layers=2",), 16,
              (("loss_spike", "launcher=ray", *RAY_ONE_GPU, "faults=loss_spike", "faults.rank=0",
                "faults.step=12", "monitor.warmup_steps=8", "monitor.good_after_steps=2"),),
              timeout_s=240, common=RAY_FAULT_COMMON),
    ),
    # Held-out quality, bf16 (two seeds: the noise) vs fp8 vs fp8 + FP8 head, on a prepared corpus
    # at corpora/stdlib_docs_32k (docs/data.md says how to make it); one suite a call. The MoE runs go through
    # launch.py (Ray Train), with a torchrun twin of its fp8 run: Ray's overhead on the same settings in one call.
    "quality_dense": (
        _quality("quality_dense", ("model=llama3_8b", "+model.overrides.n_layers=4"), (
            ("bf16", "precision=bf16"), ("fp8", "precision=fp8"),
            ("fp8_head", "precision=fp8", "precision.fp8_output_head=true"),
            ("bf16_seed1", "precision=bf16", "train.seed=1")), timeout_s=520),
    ),
    "quality_moe": (
        _quality("quality_moe", ("model=deepseek_moe16b", "+model.overrides.n_layers=4"), (
            ("bf16", "launcher=ray", *RAY_ONE_GPU, "precision=bf16"),
            ("fp8", "launcher=ray", *RAY_ONE_GPU, "precision=fp8"),
            ("fp8_head", "launcher=ray", *RAY_ONE_GPU, "precision=fp8", "precision.fp8_output_head=true"),
            ("fp8_torchrun", "precision=fp8")), timeout_s=590),
    ),
    # bf16's own spread on the MoE (two seeds, torchrun): the noise the quality gaps are read against.
    "quality_moe_seeds": (
        _quality("quality_moe_seeds", ("model=deepseek_moe16b", "+model.overrides.n_layers=4"), (
            ("bf16", "precision=bf16"), ("bf16_seed1", "precision=bf16", "train.seed=1")), timeout_s=280),
    ),
    "checkpoint": (
        # Training stall per save, background vs synchronous, ~13 GB a save (2 MoE-width layers, fp32 master + AdamW).
        _loop("checkpoint_async", MOE_LOOP + ("+model.overrides.n_layers=2",), 24,
              (("async", "checkpoint.async_save=always"), ("sync", "checkpoint.async_save=never")),
              timeout_s=420, extra=("precision=fp8", "precision.fp8_output_head=true", "checkpoint.every_steps=8", "checkpoint.keep_last=2")),
        Benchmark("pinned_staging", "pinned_staging.py", ("--gib", "13"), "pinned_staging.json", timeout_s=150),
    ),
}
SUITES["all"] = tuple(b for suite in ("kernels", "dense", "moe", "loop", "mission",
                                      "checkpoint", "quality_dense", "quality_moe", "quality_moe_seeds", "ray_dense",
                                      "ray_faults")
                      for b in SUITES[suite])
# CPU check of the runner and two programs at tiny shapes (no GPU needed): the kernels in the Triton interpreter,
# the MoE FFN on fp8.grouped's emulated path.
SUITES["smoke"] = (
    Benchmark("fp8_kernels_smoke", "fp8_kernels.py", ("--smoke",), "fp8_kernels_smoke.json", timeout_s=300),
    Benchmark("moe_grouped_smoke", "moe_grouped.py", ("--m", "512", "--experts", "4", "--dim", "64", "--hidden", "32",
                                                      "--cases", "bf16_eager", "ours_eager", "--budget-s", "60"),
              "moe_grouped.json", timeout_s=300),
)


def select(suite: str, only: list[str] | None = None) -> tuple[Benchmark, ...]:
    """The suite's benchmarks, narrowed to `only` (names) when given; unknown names are an error naming the valid."""
    if suite not in SUITES:
        raise SystemExit(f"unknown suite {suite!r}: choose one of {', '.join(SUITES)}")
    chosen = SUITES[suite]
    if only:
        names = [b.name for b in chosen]
        unknown = [n for n in only if n not in names]
        if unknown:
            raise SystemExit(f"--only {' '.join(unknown)}: not in suite {suite!r} (it has {', '.join(names)})")
        chosen = tuple(b for b in chosen if b.name in only)
    return chosen


def missing(modules) -> list[str]:
    return [m for m in dict.fromkeys(modules) if importlib.util.find_spec(m) is None]


def install_wheels(wheel_dir: Path, site: Path) -> list[str]:
    """pip-install every wheel of wheel_dir into site (no index, no dependencies: the image has the rest), put site
    first on this process's path and on PYTHONPATH for the benchmarks; returns the wheels' file names."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        return []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    return [w.name for w in wheels]


def prepare_modules(benchmarks, wheel_dir: Path, site: Path) -> list[str]:
    """Make the required modules importable, installing wheels when one is missing; returns the optional modules
    still missing. Stops with what to download when a required one cannot be had."""
    required = [m for b in benchmarks for m in b.requires]
    optional = [m for b in benchmarks for m in b.optional]
    if missing(required + optional):
        installed = install_wheels(wheel_dir, site)
        if installed:
            log.info("installed from %s: %s", wheel_dir, " ".join(installed))
    lacking = missing(required)
    if lacking:
        wanted = " ".join(DISTRIBUTIONS.get(m, m) for m in lacking)
        raise SystemExit(f"these benchmarks need {', '.join(lacking)}, which neither Python nor {wheel_dir} has: "
                         f"put wheels of {wanted} into {wheel_dir} (`make bench-wheels` on a machine with network)")
    still = missing(optional)
    for m in still:
        log.warning("%s is not installed: its comparison rows are left out (add a %s wheel to %s)", m,
                    DISTRIBUTIONS.get(m, m), wheel_dir)
    return still


def default_run_root() -> Path:
    """/dev/shm when it has room for an 8B-width checkpoint's copy (tens of GB), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 62e9:
        return shm / "elastic_fp8_bench"
    return Path(tempfile.gettempdir()) / "elastic_fp8_bench"


def run_one(bench: Benchmark, scratch: Path, run_root: Path) -> tuple[int | str, float, str]:
    """Run one program, streaming its output; (return code or "timeout", wall seconds, the output's last lines)."""
    out_dir = scratch / bench.name
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = bench.command(out_dir, run_root)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    tail: collections.deque[str] = collections.deque(maxlen=40)
    t0 = time.time()
    # Own process group: on a timeout the program and whatever it started (compile workers, torchrun) all go.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    expired = threading.Event()

    def kill_group() -> None:
        expired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(bench.timeout_s, kill_group)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
        rc: int | str = proc.wait()
    finally:
        timer.cancel()
    if expired.is_set():
        rc = "timeout"
    return rc, time.time() - t0, "\n".join(tail)


def collect(bench: Benchmark, out_dir: Path):
    """The program's JSON output, None when it wrote none."""
    path = out_dir / bench.output
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=tuple(SUITES))
    ap.add_argument("--only", nargs="*", default=None, help="benchmark names of the suite to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and result files, run nothing")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--wheels", type=Path, default=REPO / ".whl")
    ap.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "elastic_fp8_bench_site")
    ap.add_argument("--scratch", type=Path, default=None, help="programs' own outputs (default: a temp dir)")
    ap.add_argument("--run-root", type=Path, default=None, help="product-loop run directories (default: /dev/shm "
                    "when it has room, else the temp dir)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    chosen = select(args.suite, args.only)
    suite_command = "python3 benchmarks/run_suite.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="elastic_fp8_bench_"))
    run_root = args.run_root or default_run_root()
    if args.dry_run:
        for b in chosen:
            print(f"{b.name}: {shlex.join(b.command(scratch / b.name, run_root))}  -> {args.results / (b.name + '.json')}")
        return 0

    from benchmarks.common import write_result

    prepare_modules(chosen, args.wheels, args.site)
    failed = []
    for b in chosen:
        log.info("%s: starting (timeout %d s)", b.name, b.timeout_s)
        rc, wall, tail = run_one(b, scratch, run_root)
        results = collect(b, scratch / b.name)
        path = write_result(args.results / f"{b.name}.json", benchmark=b.name, suite=args.suite,
                            command=shlex.join(b.command(scratch / b.name, run_root)), suite_command=suite_command,
                            returncode=rc, wall_s=wall, results=results,
                            output_tail=None if rc == 0 and results is not None else tail)
        if rc != 0 or results is None:
            failed.append(b.name)
        log.info("%s: rc=%s, %.0f s -> %s", b.name, rc, wall, path)
    if failed:
        log.error("no complete result from: %s (their files hold the output's end)", ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
