"""The same worker loop without Ray, for machines that cannot carry Ray (the multi-GPU device image) or for
debugging:

    torchrun --nproc_per_node=8 -m orchestration.driver.torchrun model=llama3_8b cluster.device=cuda run_name=x ...

Hydra overrides as for launch.py. No elasticity here: the world size is torchrun's. With --max-restarts=N torchrun
restarts the whole group after a failure, and a restart continues the run as Ray Train's restart of a lost worker
does: no new run_start, a worker_lost event, a resume from the latest checkpoint, one run_end when the last attempt
ends. Everything else - FSDP2, FP8, monitors, checkpoints, the run directory - is the worker loop of a Ray run.
"""

from __future__ import annotations

import os
import sys
import time

from orchestration.config import REPO_ROOT, ConfigError, to_dict
from orchestration.driver.cli import COMPOSITION_ERRORS, CONFIG_ERROR_EXIT, composition_error_line, configure_logging
from orchestration.machine_defaults import NO_GPU, Machine
from orchestration.validation import resolve_job


def this_process_gpus(world: int) -> Machine:
    """The GPUs torchrun gave this job, as this worker process sees them (it will use one of them anyway)."""
    import torch

    if not torch.cuda.is_available():
        return NO_GPU
    p = torch.cuda.get_device_properties(0)
    vendor = "rocm" if torch.version.hip else "cuda"
    return Machine(gpu_vendor=vendor, gpu_count=world, gpu_memory_gb=round(p.total_memory / 1024**3, 1),
                   gpu_name=p.name, source=f"torchrun: {world} x {p.name}")


def main(argv: list[str]) -> int:
    from hydra import compose, initialize_config_dir

    configure_logging()
    try:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=argv)
    except COMPOSITION_ERRORS as exc:
        print(composition_error_line(exc), file=sys.stderr)
        return CONFIG_ERROR_EXIT
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun fixes the world size: the elastic range is this one size.
    cfg.cluster.min_workers = cfg.cluster.max_workers = world
    try:
        job, machine_notes = resolve_job(cfg, this_process_gpus(world))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT

    from orchestration.driver.plan import fp8_layer_plan, plan_record, start_lines
    from orchestration.driver.ray_job import (
        close_run_dir,
        default_run_name,
        export_at_end,
        final_error,
        final_status,
        open_run_dir,
        print_summary,
        worker_env,
    )
    from orchestration.driver.start_checks import resolve_run_root
    from orchestration.observability.events import CONFIG_FILE, EVENTS_FILE, FINAL_STATE_FILE, RunDir, read_jsonl
    from orchestration.training.loop import train_loop
    from orchestration.training.process_group import torchrun_store_prefix

    try:
        torchrun_store_prefix(os.environ)  # refuses a torchrun whose restarts cannot rendezvous
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - attempt
    # torchrun's run id is the literal "none" unless --rdzv-id (or --standalone) sets one: every such launch would
    # share runs/none and resume each other. Ask for a name instead.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not job.run_name and run_id == "none":
        print("config error: run_name: torchrun gave no run id (TORCHELASTIC_RUN_ID=none); pass run_name=NAME "
              "or torchrun --standalone / --rdzv-id", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    run_name = job.run_name or run_id or default_run_name(job)
    t_start = time.time()
    run_path = resolve_run_root(job) / run_name
    # A torchrun restart of this launch: the first attempt opened the run directory (and passed the start checks).
    restarted = attempt > 0 and (run_path / CONFIG_FILE).is_file()
    lock = None
    if rank == 0:
        from orchestration.driver.run_lock import RunLock

        # The run's lease (driver/run_lock.py). A torchrun restart takes it over: the failed attempt's rank 0 has
        # exited before torchrun starts the next one, and a holder whose pid is gone holds nothing.
        try:
            lock = RunLock(run_path).acquire()
            if not restarted:
                plan = {"machine": machine_notes, "fp8_layers": fp8_layer_plan(job)}
                for line in start_lines(plan):
                    print(line, flush=True)
                run_dir = open_run_dir(job, run_name, launcher="torchrun", world_size=world, **plan_record(plan))
        except ConfigError as exc:  # refused before the run directory changed
            if lock is not None:
                lock.release()
            print(f"config error: {exc}", file=sys.stderr)
            return CONFIG_ERROR_EXIT
    if rank != 0 or restarted:
        run_dir = RunDir(run_path)
    if rank == 0 and restarted:
        # A final state the failed attempt wrote is not this attempt's; the run's wall time counts from its start.
        (run_path / FINAL_STATE_FILE).unlink(missing_ok=True)
        starts = [e["time"] for e in read_jsonl(run_path / EVENTS_FILE) if e["event"] == "run_start"]
        t_start = starts[-1] if starts else t_start
    import torch.distributed as dist

    try:
        # The cluster's NCCL/RCCL preset and env_vars, as the Ray driver hands them to its workers.
        train_loop({"job": to_dict(job), "run_dir": str(run_dir.path), "run_name": run_name,
                    "env": worker_env(job), "launcher": "torchrun", "group_id": f"torchrun-attempt{attempt}"})
    finally:
        # Also when the loop raised: rank 0 still writes run_end and a summary ("failed": no final state).
        if dist.is_initialized():
            # Tear gloo/NCCL down before interpreter exit: live communicator threads at exit abort the process
            # ("terminate called without an active exception") and torchrun reports the run as failed. After a
            # failure the peers may be gone: abort-free destroy without the barrier.
            if sys.exc_info()[0] is None:
                dist.barrier()
            dist.destroy_process_group()
        if rank == 0:
            status = final_status(run_dir) or "failed"
            if final_error(run_dir):
                print(f"Training failed: {final_error(run_dir)}", file=sys.stderr, flush=True)
            if status != "completed" and restarts_left > 0:
                # This process exits non-zero, so torchrun restarts the group: the run goes on, it has no end yet.
                print(f"Worker group ended {status}; torchrun restarts it ({restarts_left} restart(s) left)",
                      file=sys.stderr, flush=True)
            else:
                export_at_end(job, run_dir, status)
                print_summary(close_run_dir(run_dir, status, t_start))
            if lock is not None:
                lock.release()
    if rank == 0:
        return 0 if status == "completed" else 1
    return 0


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    # Leave without interpreter finalization. Everything this process owns is closed by now (run directory,
    # checkpoints, process groups), but C++ threads that gloo and the compile workers leave behind can still
    # call std::terminate while the interpreter tears down ("terminate called without an active exception",
    # SIGABRT on a rank after a completed run, seen in CI), and torchrun then reports a run that finished as
    # failed. atexit is skipped too, so flush what atexit would have: logging handlers and the std streams.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
