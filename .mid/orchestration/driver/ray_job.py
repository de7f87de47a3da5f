"""Driver side: open the run directory (after the checks of start_checks.py), start or join Ray, build the Ray Train
TorchTrainer, show progress, write the summary."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestration.config import REPO_ROOT, JobConfig, redact_secrets, to_dict
from orchestration.driver.start_checks import check_disk_space, check_start, checkpoint_bytes, resolve_run_root
from orchestration.observability.console import ConsoleLines, RunDirTail
from orchestration.observability.events import (
    EVENTS_FILE,
    FINAL_STATE_FILE,
    METRICS_FILE,
    PREEMPT_FILE,
    STOP_FILE,
    SUMMARY_FILE,
    RunDir,
    read_jsonl,
    summarize,
)
from orchestration.observability.provenance import hydra_job, start_record

log = logging.getLogger(__name__)


def default_run_name(job: JobConfig) -> str:
    return f"{job.model.name}-{job.precision.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def ray_storage_path(job: JobConfig, run_root: Path) -> str:
    return job.cluster.storage_path if job.cluster.storage_path else str(run_root / "_ray")


def worker_env(job: JobConfig) -> dict[str, str]:
    from orchestration.driver.env_presets import resolve_worker_env

    env = resolve_worker_env(job.cluster.env_preset, dict(job.cluster.env_vars))
    # The user's explicit W&B choices reach the workers; otherwise logging.wandb_mode decides (auto/offline).
    # Never the API key: the train config is visible in the Ray dashboard. Workers of an embedded cluster inherit
    # it from the driver's environment; remote nodes need it in their own environment (docs/deploy.md).
    for key in ("WANDB_MODE", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
        if os.environ.get(key):
            env.setdefault(key, os.environ[key])
    return env


def driver_env(job: JobConfig) -> dict[str, str]:
    """Ray Train knobs read by the controller and the worker group (report latency, start timeout), and
    the state tracking behind the dashboard's Train view (read where the trainer is built: this driver)."""
    from orchestration.observability.dashboard import state_tracking_env

    return {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(job.cluster.health_check_interval_s),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(job.cluster.worker_group_start_timeout_s),
        "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(job.cluster.drain_poll_interval_s),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", default_auth_mode(job)),
        **state_tracking_env(),
    }


def default_auth_mode(job: JobConfig) -> str:
    """Ray's token authentication for an embedded cluster, unless RAY_AUTH_MODE says otherwise. Ray 2.60 binds its
    GCS, raylet and worker gRPC servers to every interface and has no option to keep them on loopback (it even
    replaces a loopback node address by the routable one), so the token is what keeps another host on the network
    from submitting work to the cluster of a laptop or a GPU box (the dashboard agent's job API answered any caller
    with auth disabled, 401 with the token). Ray creates the token in ~/.ray/auth_token. A cluster joined by address
    keeps its own setting (docs/deploy.md: what to secure there)."""
    return "disabled" if (job.cluster.address or os.environ.get("RAY_ADDRESS")) else "token"


@dataclass
class RayPlan:
    """What launch.py hands to Ray Train; built without Ray so dry runs and tests can check it."""

    num_workers: int | tuple[int, int]
    use_gpu: bool
    resources_per_worker: dict[str, float]
    storage_path: str
    name: str
    max_failures: int
    backend: str
    address: str | None
    elastic_resize_interval_s: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def ray_plan(job: JobConfig, run_name: str, run_root: Path) -> RayPlan:
    c = job.cluster
    elastic = c.min_workers != c.max_workers
    use_gpu = c.gpus_per_worker > 0 and c.device != "cpu"
    resources = {"CPU": c.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = c.gpus_per_worker
    return RayPlan(num_workers=(c.min_workers, c.max_workers) if elastic else c.min_workers, use_gpu=use_gpu,
                   resources_per_worker=resources, storage_path=ray_storage_path(job, run_root), name=run_name,
                   max_failures=c.max_failures, backend="nccl" if use_gpu else "gloo",
                   address=c.address or os.environ.get("RAY_ADDRESS"),
                   elastic_resize_interval_s=c.elastic_resize_interval_s)


class ProgressPrinter:
    """Tails the run directory while the workers write it and prints what a person watching cares about: a progress
    line (the first when the first step ends, then one every `every_s`) and a line per event as it happens
    (orchestration/observability/console.py says which)."""

    def __init__(self, run_dir: Path, every_s: float, total_steps: int, poll_s: float = 0.5):
        # Records written before this start (a resumed run's previous starts) are not news: only newer ones.
        since = time.time()
        self.lines = ConsoleLines(total_steps, every_s)
        self.events = RunDirTail(run_dir / EVENTS_FILE, since)
        self.metrics = RunDirTail(run_dir / METRICS_FILE, since)
        self.poll_s = poll_s
        self._newest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # not started when Ray failed to start
            self._thread.join(timeout=2)
        self._print_new()
        last = self.lines.last(self._newest, time.time()) if self._newest else None
        if last:
            print(last, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._print_new()

    def _print_new(self) -> None:
        now = time.time()
        # Both files in the order the run wrote them (an eval's fallback after the metrics line that shows it).
        records = sorted([(e.get("time", now), 0, e) for e in self.events.read()]
                         + [(m.get("time", now), 1, m) for m in self.metrics.read()], key=lambda r: r[:2])
        lines: list[str] = []
        for _, is_metrics, record in records:
            if is_metrics:
                lines += self.lines.metrics(record, now)
                self._newest = record
            elif (line := self.lines.event(record)) is not None:
                lines.append(line)
        if lines:
            print("\n".join(lines), flush=True)


def keep_embedded_cluster_on_loopback() -> None:
    """An embedded cluster is one machine: give Ray 127.0.0.1 as the node's address, so that GCS, raylet, the agents
    and the workers' gRPC servers listen on loopback only. Ray 2.60 binds its servers to the node address and takes
    a routable one unless ENABLE_RAY_CLUSTER is off (its single-machine mode, the default on macOS/Windows, switched
    by RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and read once when ray is imported; the services started below inherit
    it). Measured here: every Ray listener on 0.0.0.0 / the node's 192.0.2.2 before, on 127.0.0.1 after."""
    import sys

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray was imported before the switch was set: the same switch, already read
        constants.ENABLE_RAY_CLUSTER = False


EMBEDDED_START_ATTEMPTS = 2


def stop_child_processes(timeout_s: float = 10.0) -> None:
    import psutil  # Ray's own copy, on the path once ray is imported

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=timeout_s)


def start_ray(job: JobConfig, plan: RayPlan, run_dir: RunDir | None = None) -> bool:
    """Join plan.address, or start an embedded local cluster. Returns True when we started it (we stop it). The
    cluster's session directory goes into the run directory (a `ray_session` event): `make monitor` follows it."""
    if not plan.address:
        keep_embedded_cluster_on_loopback()
    import ray
    from ray.job_config import JobConfig as RayJobConfig

    from orchestration.observability.dashboard import job_metadata

    env = driver_env(job)
    os.environ.update(env)
    runtime_env = dict(job.cluster.runtime_env)
    runtime_env.setdefault("env_vars", {}).update(env)
    if not plan.address:
        # One machine: gloo's and NCCL's bootstrap sockets on loopback too (the store: keep_store_on_loopback).
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            runtime_env["env_vars"].setdefault(key, os.environ.get(key, "lo"))
    # Ray imports the setup hook below before it puts the driver's directory on a worker's path: without the repository
    # on PYTHONPATH, every worker died with "No module named 'orchestration'" on a GPU machine where the project is
    # run from its checkout rather than pip-installed.
    runtime_env["env_vars"].setdefault(
        "PYTHONPATH", os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    runtime_env.setdefault("worker_process_setup_hook", "orchestration.driver.ray_logs.prepare_worker_process")
    # The run's name in the Name column of the dashboard's Jobs page (a job submitted with its own metadata keeps it).
    job_config = RayJobConfig(metadata=job_metadata(plan.name))
    if plan.address:
        ctx = ray.init(address=plan.address, runtime_env=runtime_env, job_config=job_config, log_to_driver=True)
        started = False
    else:
        cpus = max(job.cluster.max_workers * job.cluster.cpus_per_worker + 1, os.cpu_count() or 1)
        # address="local": always a fresh cluster of our own, never a stray one found via /tmp/ray. The dashboard
        # reads RAY_PROMETHEUS_HOST / RAY_GRAFANA_HOST from this process's environment (docs/deploy.md).
        for attempt in range(1, EMBEDDED_START_ATTEMPTS + 1):
            try:
                ctx = ray.init(address="local", num_cpus=int(cpus), runtime_env=runtime_env, job_config=job_config,
                               include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True)
                break
            except Exception as exc:  # Ray raises a bare Exception for it
                # Ray waits a fixed 30 s for its raylet to register with the GCS; on a machine loaded by other work
                # the first start can miss it. A second start, after this one's processes are stopped, gets another
                # 30 s.
                if "timed out during startup" not in str(exc) or attempt == EMBEDDED_START_ATTEMPTS:
                    raise
                log.warning("Ray's local cluster did not start within Ray's 30 s (%s); starting it again", exc)
                ray.shutdown()
                stop_child_processes()  # the failed start's GCS and raylet: nothing else runs under the driver yet
        started = True
    from orchestration.driver.ray_logs import filter_forwarded_output

    filter_forwarded_output()
    url = getattr(ctx, "dashboard_url", None)
    if run_dir is not None:
        run_dir.event("ray_session", step=0, session_dir=ctx.address_info.get("session_dir"),
                      dashboard_url=f"http://{url}" if url else None)
    if url:
        from orchestration.observability.dashboard import ray_cli, token_location, watch_lines

        token_auth = os.environ.get("RAY_AUTH_MODE") == "token"
        print("\n".join(watch_lines(f"http://{url}", token_auth, ray_cli(), token_location())), flush=True)
    return started


def open_run_dir(job: JobConfig, run_name: str, **start_fields: Any) -> RunDir:
    """Driver side of a start (Ray or torchrun): config.yaml, the run_start event, no stale final state."""
    check_start(job, run_name)

    check_disk_space(job, resolve_run_root(job) / run_name, checkpoint_bytes(job))
    run_dir = RunDir(resolve_run_root(job) / run_name)
    config = redact_secrets(to_dict(job))
    config["run_name"] = run_name
    run_dir.write_config(config)
    # Written by the workers when their loop ends; a stale one from an earlier start of this run must not make an
    # aborted start look completed.
    (run_dir.path / FINAL_STATE_FILE).unlink(missing_ok=True)
    (run_dir.path / STOP_FILE).unlink(missing_ok=True)  # a Ctrl-C of an earlier start asked that one to stop
    (run_dir.path / PREEMPT_FILE).unlink(missing_ok=True)  # and a SIGTERM
    run_dir.event("run_start", step=0, run_name=run_name, model=job.model.name, precision=job.precision.name,
                  **start_record(REPO_ROOT), **start_fields)
    print(f"Run directory: {run_dir.path}", flush=True)
    return run_dir


def final_status(run_dir: RunDir) -> str | None:
    """The status the workers wrote when their loop ended; None when they never got there."""
    final = run_dir.path / FINAL_STATE_FILE
    return json.loads(final.read_text()).get("status", "completed") if final.exists() else None


def final_error(run_dir: RunDir) -> str | None:
    """Why the workers ended the run as failed, when they knew (e.g. no space left for a checkpoint)."""
    final = run_dir.path / FINAL_STATE_FILE
    return json.loads(final.read_text()).get("error") if final.exists() else None


def export_at_end(job: JobConfig, run_dir: RunDir, status: str) -> None:
    """checkpoint.export_hf=final: a completed run's last checkpoint written as a Hugging Face directory in
    <run_dir>/hf/step_NNNNNN, with an hf_exported event (or hf_export_failed: the run itself stays completed)."""
    if job.checkpoint.export_hf != "final" or status != "completed":
        return
    from orchestration.checkpoint.directory import step_dir_name
    from orchestration.export import export_run, select_checkpoint

    try:
        step = select_checkpoint(run_dir.path, "latest").step
        report = export_run(run_dir.path, run_dir.path / "hf" / step_dir_name(step), step=str(step))
    except Exception as exc:  # noqa: BLE001  # the run stays completed; its run_end and summary still get written
        log.error("checkpoint.export_hf=final: the export failed: %s", exc)
        run_dir.event("hf_export_failed", step=_last_step(run_dir.path), error=str(exc)[:2000])
        return
    print(f"Hugging Face export: {report['out']}", flush=True)
    run_dir.event("hf_exported", step=report["step"], path=report["out"], dtype=report["dtype"],
                  tensors=report["tensors"], shards=report["shards"], seconds=report["seconds"])


def close_run_dir(run_dir: RunDir, status: str, t_start: float) -> dict[str, Any]:
    """The run_end event and summary.json, built from the run directory alone. On a full disk the summary is
    still returned (and printed by the caller), with a message instead of the file."""
    summary = summarize(run_dir.path, status, wall_time_s=round(time.time() - t_start, 2))
    summary["run_dir"] = str(run_dir.path)
    try:
        run_dir.event("run_end", step=_last_step(run_dir.path), status=status)
        run_dir.write_json(SUMMARY_FILE, summary)
    except OSError as exc:
        (run_dir.path / (SUMMARY_FILE + ".tmp")).unlink(missing_ok=True)
        log.error("cannot write %s in %s: %s; the summary is printed below", SUMMARY_FILE, run_dir.path, exc)
    return summary


def fit_until_done_or_stopped(trainer: Any, run_dir: RunDir, grace_s: float = 30.0) -> bool:
    """trainer.fit() in a thread, so that Ctrl-C reaches this driver and not Ray Train's handler (it registers one
    only on the main thread, and aborts the workers wherever they are: a run went on training and wrote two
    checkpoints during its exit). The first Ctrl-C asks the workers to stop at their next logged step (they
    look for STOP_FILE there, agree, and end their loop as "interrupted", an in-flight save finished); a second
    one, or grace_s without them stopping, returns at once and the caller stops the cluster. Returns whether the
    user interrupted; raises fit's error otherwise."""
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    interrupted, deadline = False, None
    restore_sigterm = forward_sigterm(run_dir)
    while thread.is_alive():
        try:
            thread.join(0.2)
        except KeyboardInterrupt:
            if interrupted:
                break
            interrupted, deadline = True, time.time() + grace_s
            (run_dir.path / STOP_FILE).touch()
            print("Interrupted: the workers stop at their next step (Ctrl-C again to stop them now).", flush=True)
        if deadline is not None and time.time() > deadline:
            break
    restore_sigterm()
    if errors and not interrupted:
        raise errors[0]
    return interrupted


def forward_sigterm(run_dir: RunDir) -> Any:
    """SIGTERM to the driver (Kubernetes, Slurm, a spot reclaim) asks the workers, through PREEMPT_FILE, to save a
    checkpoint at their next step boundary and stop; the driver then waits for them as for any end of fit (Ray's own
    handler had it exit at once, 134, with nothing saved). A second SIGTERM ends the driver at once. Main thread
    only (signal handlers belong to it). Returns the function that puts the previous handler back."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        if (run_dir.path / PREEMPT_FILE).exists():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        (run_dir.path / PREEMPT_FILE).touch()
        print("SIGTERM: the workers save a checkpoint at their next step, then stop (SIGTERM again to stop now).",
              flush=True)

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, previous)


_SWEEP_NAME: str | None = None


def in_sweep_directory(job: JobConfig) -> JobConfig:
    """One job of a multirun (`launch.py -m ...`, its jobs run one after another in this process): its run goes
    under <run root>/sweep-<time the sweep's first job started>/, named <job number>_<run name or model-precision>,
    so the sweep is one directory that `python -m orchestration.report` takes. Other jobs are returned as they are."""
    global _SWEEP_NAME
    sweep_job = hydra_job().get("sweep_job")
    if sweep_job is None:
        return job
    _SWEEP_NAME = _SWEEP_NAME or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    name = f"{sweep_job}_{job.run_name or f'{job.model.name}-{job.precision.name}'}"
    return replace(job, run_root=str(resolve_run_root(job) / _SWEEP_NAME), run_name=name)


def run_job(job: JobConfig, plan_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole job on Ray; returns summary.json's content. Ctrl-C stops workers and the embedded cluster. The run's
    lease (driver/run_lock.py) is held from before the start checks to after the summary: a second start of a run
    that is running is refused (RunLocked, a ConfigError: exit 2) before it reads or writes anything of the run.
    plan_fields: what the launcher's plan decided (driver/plan.py plan_record), kept in the run_start event."""
    from orchestration.driver.run_lock import hold_run_lock

    job = in_sweep_directory(job)
    run_name = job.run_name or default_run_name(job)
    with hold_run_lock(resolve_run_root(job) / run_name):
        return run_job_holding_lock(job, run_name, plan_fields or {})


def run_job_holding_lock(job: JobConfig, run_name: str, plan_fields: dict[str, Any]) -> dict[str, Any]:
    plan = ray_plan(job, run_name, resolve_run_root(job))
    t_start = time.time()
    run_dir = open_run_dir(job, run_name, ray=plan.to_dict(), **plan_fields)
    from orchestration.driver.leftovers import RayProcessRecord, end_leftovers

    ended = end_leftovers(run_dir.path)  # a dead start's cluster (driver/leftovers.py); this start holds the lease
    if ended:
        run_dir.event("ray_leftovers_ended", step=0, pids=[p["pid"] for p in ended])

    # Ray reads RAY_AUTH_MODE when it is imported: the driver's settings reach the environment first.
    os.environ.update(driver_env(job))
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from orchestration.training.loop import train_loop

    progress = ProgressPrinter(run_dir.path, job.logging.progress_every_s, job.train.steps)
    status = "failed"
    started = False
    ray_processes = None
    try:
        try:
            started = start_ray(job, plan, run_dir)
            if started:
                ray_processes = RayProcessRecord(run_dir.path).start()
        except ConnectionError as exc:
            raise RuntimeError(f"cannot reach the Ray cluster at cluster.address={plan.address!r} ({exc}); start "
                               "it (ray start --head) or set cluster.address=null for an embedded local cluster") \
                from None
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"job": to_dict(job), "run_dir": str(run_dir.path), "run_name": run_name,
                               "env": worker_env(job), "launcher": "ray"},
            scaling_config=ScalingConfig(num_workers=plan.num_workers, use_gpu=plan.use_gpu,
                                         resources_per_worker=plan.resources_per_worker,
                                         elastic_resize_monitor_interval_s=plan.elastic_resize_interval_s),
            torch_config=TorchConfig(backend=plan.backend),
            run_config=RunConfig(name=run_name, storage_path=plan.storage_path,
                                 failure_config=FailureConfig(max_failures=plan.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2),
                                 # Ray Train's INFO lines (a "Reporting training result" line per worker per report,
                                 # state transitions) stay in its log files under the Ray session; the console shows
                                 # our progress line and Ray Train's warnings and errors.
                                 logging_config=LoggingConfig(log_level="WARNING")),
        )
        progress.start()
        interrupted = fit_until_done_or_stopped(trainer, run_dir)
        # Workers write final_state.json when their loop ends; a fit that returns without it was aborted.
        status = final_status(run_dir) or "interrupted"
        if interrupted:
            status = "interrupted"
        elif status == "failed":
            log.error("Training failed: %s", final_error(run_dir) or f"see the events in {run_dir.path}")
    except (KeyboardInterrupt, SystemExit):
        status = "interrupted"
    except Exception as exc:  # noqa: BLE001  # a failed fit (max_failures exhausted) still gets a summary
        status = "failed"
        log.error("Training failed: %s: %s", type(exc).__name__, exc)
    finally:
        progress.stop()
        export_at_end(job, run_dir, status)
        summary = close_run_dir(run_dir, status, t_start)
        if started:
            ray.shutdown()
        if ray_processes is not None:
            ray_processes.stop()
    print_summary(summary)
    print(f"Run directory: {run_dir.path}", flush=True)
    return summary


def _last_step(path: Path) -> int:
    metrics = read_jsonl(path / METRICS_FILE)
    return metrics[-1]["step"] if metrics else 0


def print_summary(summary: dict[str, Any]) -> None:
    stall = (f"{_fmt(summary.get('checkpoint_stall_s'), '.1f')} over {summary.get('checkpoint_saves')} saves "
             f"({summary.get('checkpoint_background_saves')} in the background)")
    rows = [("status", summary["status"]), ("final step", summary["final_step"]),
            ("first loss", _fmt(summary["first_loss"])), ("final loss", _fmt(summary["final_loss"])),
            ("final eval loss", (f"{_fmt(summary.get('final_eval_loss'))} (step {summary.get('final_eval_step')}, "
                                 f"{_fmt(summary.get('eval_s_mean'), '.2f')} s per eval)")),
            ("tokens/s (mean)", _fmt(summary["tokens_per_s"], ",.0f")),
            ("world sizes seen", summary["world_sizes_seen"]), ("restarts", summary["restarts"]),
            ("resumes", summary.get("resumes", 0)),
            ("rollbacks", summary["rollbacks"]), ("fallbacks to bf16", summary["fallbacks"]),
            ("skipped steps", summary.get("skipped_steps", 0)),
            ("samples consumed", summary["samples_consumed"]),
            ("checkpoint stall (s)", stall),
            ("wall time (s)", summary["wall_time_s"])]
    width = max(len(k) for k, _ in rows)
    print("=" * (width + 24))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("=" * (width + 24), flush=True)


def _fmt(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value)
