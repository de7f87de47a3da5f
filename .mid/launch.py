"""elastic-fp8 entry point: compose the Hydra config, validate it, plan, train on Ray, summarise.

    python launch.py                                  # the default job (debug MoE, fp8, 2 local workers)
    python launch.py model=deepseek_moe16b precision=fp8 dry_run=true
    python launch.py --help                           # groups and options
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from orchestration.config import ConfigError
from orchestration.driver.cli import CONFIG_ERROR_EXIT, config_composed, configure_logging, run_hydra_main
from orchestration.validation import resolve_job

DOES_NOT_FIT_EXIT = 3  # a plan that does not fit the cluster's memory, dry run or launch


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    config_composed()
    configure_logging()
    from orchestration.driver.machine import detect_machine

    try:
        # What the machine has decides the settings left null: GPUs and their memory, then the data shape.
        job, machine_notes = resolve_job(cfg, detect_machine(cfg.cluster), enforce_machine=not cfg.dry_run)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)

    from orchestration.driver.plan import build_job_plan, plan_record, print_plan, start_lines

    plan = build_job_plan(job, machine_notes)
    if job.dry_run:
        print_plan(plan)
        print("PLAN " + json.dumps(plan), flush=True)
        if not plan["fits"]:
            sys.exit(DOES_NOT_FIT_EXIT)  # the plan's reasons say which term does not fit and what to change
        return
    if not plan["fits"]:
        print_plan(plan)
        print("error: the model does not fit the cluster (nothing was allocated):", file=sys.stderr)
        for reason in plan["reasons"]:
            print(f"  - {reason}", file=sys.stderr)
        sys.exit(DOES_NOT_FIT_EXIT)

    from orchestration.driver.ray_job import run_job

    for line in start_lines(plan):
        print(line, flush=True)
    try:
        summary = run_job(job, plan_record(plan))
    except ConfigError as exc:  # refused before the run directory changed (driver/start_checks.py check_start)
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
    if summary["status"] not in ("completed",):
        sys.exit(1)


if __name__ == "__main__":
    run_hydra_main(main)  # a config Hydra refuses exits 2 with one line, as our own checks do
