"""Weights & Biases logging for one training run: offline by default, one W&B run per run directory.

- Mode: `resolve_mode` (offline unless WANDB_MODE or, with mode="auto", a WANDB_API_KEY says online).
- One W&B run per training run: its id lives in run_dir/wandb_run_id, created once and reused by every restart
  or resize (wandb.init(id=..., resume="allow")). Offline, each restart writes one more
  run_dir/wandb/offline-run-<time>-<id>/ directory; `wandb sync --id <id> run_dir/wandb/offline-run-*` uploads
  them in start order as one run.
- Steps: W&B's own step counter must grow monotonically, but ours goes back after a rollback. So every row
  carries our step as the metric "step" and all charts use it as their x axis (define_metric step_metric);
  W&B's internal _step just counts rows.
- Secrets (keys containing key/token/password/secret) never reach W&B; nothing is written outside run_dir unless
  the user set WANDB_CACHE_DIR / WANDB_DATA_DIR / WANDB_CONFIG_DIR themselves (online, ~/.config/wandb is read
  for the user's login host and entity, so it is not redirected).
- Observability never kills training: if wandb fails to start, the run logs a warning and becomes a no-op.

`read_offline_history` / `read_offline_run` (orchestration/observability/wandb_offline.py) read the offline .wandb
files back.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import secrets
import string
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Self

from orchestration.config import is_secret_key
from orchestration.observability.events import EVENTS_FILE, METRICS_FILE, read_jsonl
from orchestration.observability.ray_metrics import precision_code  # one mapping for W&B and Ray
from orchestration.observability.wandb_offline import (
    RUN_ID_FILE,
    OfflineRun,
    offline_segments,
    read_segments,
    wait_until_flushed,
)

log = logging.getLogger(__name__)

MODES = ("online", "offline", "disabled")
# Events worth a W&B alert (online only: offline alerts would fire hours later at sync time).
ALERT_EVENTS = ("divergence_detected", "rollback", "worker_lost")
# Statuses that mark the W&B run as finished cleanly (others give exit code 1, shown as "failed").
OK_STATUSES = (None, "completed")
EVENT_TABLE_COLUMNS = ["time", "event", "step", "rank", "details"]


# ----------------------------------------------------------------------------------------------------------------
# Pure helpers


def scrub_secrets(value: Any) -> Any:
    """A copy of a nested dict/list config with every secret-looking key removed (not masked: removed)."""
    if isinstance(value, Mapping):
        return {k: scrub_secrets(v) for k, v in value.items() if not is_secret_key(k)}
    if isinstance(value, (list, tuple)):
        return [scrub_secrets(v) for v in value]
    return value


def resolve_mode(mode: str = "offline", enabled: bool = True, environ: Mapping[str, str] | None = None) -> str:
    """The W&B mode to run in: "online" | "offline" | "disabled".

    Order: disabled by config wins; then WANDB_MODE from the environment (the user's explicit choice at launch);
    then the configured mode, where "auto" means online when WANDB_API_KEY is set and offline otherwise.
    """
    env = os.environ if environ is None else environ
    if not enabled or mode == "disabled":
        return "disabled"
    env_mode = env.get("WANDB_MODE", "").strip().lower()
    if env_mode:
        env_mode = {"dryrun": "offline", "run": "online"}.get(env_mode, env_mode)
        if env_mode not in MODES:
            raise ValueError(f"WANDB_MODE={env['WANDB_MODE']!r} is not one of {MODES} (or dryrun/run); "
                             f"unset it or set one of these")
        return env_mode
    if mode == "auto":
        return "online" if env.get("WANDB_API_KEY") else "offline"
    if mode not in MODES:
        raise ValueError(f"W&B mode {mode!r} is not one of {MODES + ('auto',)}")
    return mode


def metrics_row(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The W&B history row for one metrics.jsonl record.

    Numbers pass through (None dropped, NaN/inf kept: a NaN loss is exactly what one wants to see); bools become
    0/1; "precision" becomes the numeric "precision_fp8" (precision_code); other strings are dropped (W&B cannot
    chart them and they are in metrics.jsonl).
    """
    row: dict[str, Any] = {"step": int(step)}
    for key, value in metrics.items():
        if key == "step" or value is None:
            continue
        if key == "precision":
            code = precision_code(value)
            if code is not None:
                row["precision_fp8"] = code
            continue
        if isinstance(value, bool):
            row[key] = int(value)
        elif isinstance(value, (int, float)):
            row[key] = value
        elif hasattr(value, "item"):  # a 0-d tensor / numpy scalar that slipped through
            row[key] = value.item()
    return row


def event_table_row(event: Mapping[str, Any]) -> list[Any]:
    details = {k: v for k, v in event.items() if k not in ("time", "event", "step", "rank")}
    return [event.get("time"), event.get("event"), event.get("step"), event.get("rank"),
            json.dumps(details, sort_keys=True, default=str)]


def is_fallback(event: Mapping[str, Any]) -> bool:
    return event.get("event") == "precision_changed" and str(event.get("to")).lower() == "bf16"


def event_counter(event: Mapping[str, Any]) -> str | None:
    """Name of the running count (logged as events/<name>) an event increments, or None."""
    if is_fallback(event):
        return "fallbacks"
    return {"divergence_detected": "divergences", "rollback": "rollbacks", "worker_lost": "workers_lost",
            "resume": "restarts", "checkpoint_saved": "checkpoints"}.get(str(event.get("event")))


def count_events(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Running counts over events.jsonl records. Agreed decisions are written by every rank, each copy tagged
    with its writer's worker_rank: count worker rank 0's copy (records without worker_rank have one writer)."""
    counts: dict[str, int] = {}
    for e in events:
        name = event_counter(e)
        if name is None or e.get("worker_rank", 0) not in (0, None):
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def alert_for(event: Mapping[str, Any]) -> tuple[str, str] | None:
    """(title, text) of the W&B alert an event deserves, or None."""
    name = event.get("event")
    step = event.get("step")
    if is_fallback(event):
        scope = event.get("scope") if event.get("scope") not in (None, "", "model") else "whole model"
        return "FP8 -> BF16 fallback", f"step {step}: precision {event.get('from')} -> bf16 ({scope})"
    if name not in ALERT_EVENTS:
        return None
    details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("time", "event", "step", "worker_rank"))
    return name.replace("_", " "), f"step {step}: {details}"


def sync_command(run_dir: Path, run_id: str) -> str:
    """The shell command that uploads every offline segment of this run, in start order, as one W&B run."""
    return f"wandb sync --id {run_id} {Path(run_dir) / 'wandb'}/offline-run-*-{run_id}"


@contextlib.contextmanager
def _tempdir_in(path: Path) -> Iterator[None]:
    """Point tempfile's default directory at `path` for the duration (wandb's temp files land there).

    wandb makes temp dirs when imported (wandb-media, wandb-artifacts) and when a Table is logged (an artifact
    staging dir); it removes them at interpreter exit, which a killed Ray worker never reaches, so they pile up
    in /tmp. Inside the run directory they are the run's business.
    """
    path.mkdir(parents=True, exist_ok=True)
    saved = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _import_wandb(tmp_root: Path):
    """Import wandb with its import-time temp dirs under tmp_root (only matters for the first import)."""
    if "wandb" in sys.modules:
        import wandb

        return wandb
    with _tempdir_in(tmp_root):
        import wandb
        import wandb.sdk.artifacts.artifact  # creates its temp dir at import
        import wandb.sdk.data_types._private  # idem
    return wandb


def read_or_create_run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory: created once (atomically, first writer wins), then reused."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.exists():
        run_id = path.read_text().strip()
        if run_id:
            return run_id
    # W&B ids are short [a-z0-9] strings; 8 characters from 36 as wandb itself generates them.
    candidate = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    tmp = path.with_name(f"{RUN_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(candidate + "\n")
    try:
        # link() fails if the file exists: two processes racing both end up with the first one's id.
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def tags_from_config(config: Mapping[str, Any]) -> list[str]:
    """W&B tags that make a sweep comparable side by side: model, precision, recipe, plus configured tags."""
    tags: list[str] = []
    model = config.get("model")
    if isinstance(model, Mapping) and model.get("name"):
        tags.append(f"model:{model['name']}")
    precision = config.get("precision")
    if isinstance(precision, Mapping):
        if precision.get("name"):
            tags.append(f"precision:{precision['name']}")
        if precision.get("recipe") and precision.get("name") != "bf16":
            tags.append(f"recipe:{precision['recipe']}")
    logging_cfg = config.get("logging")
    if isinstance(logging_cfg, Mapping):
        tags.extend(str(t) for t in (logging_cfg.get("tags") or []))
    return list(dict.fromkeys(tags))  # order kept, duplicates dropped


def group_from_config(config: Mapping[str, Any]) -> str | None:
    """The W&B group: logging.group if set, else the model name (runs of one model compare side by side)."""
    logging_cfg = config.get("logging")
    if isinstance(logging_cfg, Mapping) and logging_cfg.get("group"):
        return str(logging_cfg["group"])
    model = config.get("model")
    if isinstance(model, Mapping) and model.get("name"):
        return str(model["name"])
    return None


# ----------------------------------------------------------------------------------------------------------------
# The run


class WandbRun:
    """One W&B run for one training run directory; call from rank 0 only.

    Use: `wb = WandbRun(run_dir, config, project=..., group=..., tags=...)`, then `wb.log_metrics(step, record)`
    for every metrics.jsonl record, `wb.log_event(event)` for every events.jsonl record, `wb.finish(summary)`.
    """

    def __init__(self, run_dir: Path, config: dict, *, project: str, group: str | None,
                 tags: list[str] | None = None, mode: str = "offline", enabled: bool = True, name: str | None = None,
                 system_metrics: bool = True):
        """tags None: tags_from_config(config)."""
        self.run_dir = Path(run_dir)
        self._tmp_dir = self.run_dir / "wandb" / ".tmp"
        self.mode = resolve_mode(mode, enabled)
        self.run = None
        self.run_id: str | None = None
        self._events: list[dict[str, Any]] = []
        self._finished = False
        self._t0 = time.time()
        self._counts: dict[str, int] = {}  # events of earlier segments, counted from events.jsonl below
        if self.mode == "disabled":
            return
        tags = tags_from_config(config) if tags is None else tags
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = read_or_create_run_id(self.run_dir)
        self._keep_files_in_run_dir()
        if self.mode == "offline":
            self._avoid_same_second_dir()
        clean_config = scrub_secrets(config)
        try:
            wandb = _import_wandb(self._tmp_dir)
        except Exception as exc:  # noqa: BLE001 - a logging failure must not stop training
            log.warning("W&B disabled for this run: wandb cannot be imported: %s", exc)
            return
        # The earlier segments' files, read before this one's exists: what they flushed is not logged again.
        try:
            previous = read_segments(self.run_id, offline_segments(self.run_dir))
        except Exception as exc:  # noqa: BLE001 - a gap in W&B is not worth stopping training for
            log.warning("W&B backfill from %s skipped: %s", METRICS_FILE, exc)
            previous = None
        try:
            settings = wandb.Settings(
                silent=True,
                console="off",  # Ray owns the workers' stdout; wrapping it twice garbles the logs
                x_disable_stats=not system_metrics,
                save_code=False,
                disable_git=True,
            )
            self.run = wandb.init(
                project=project, group=group, tags=list(tags), name=name or self.run_dir.name,
                config=clean_config, id=self.run_id, resume="allow", dir=str(self.run_dir),
                mode=self.mode, reinit="create_new", settings=settings,
            )
            # Our step (not W&B's row counter) is the x axis: it goes back after a rollback.
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")
        except Exception as exc:  # noqa: BLE001 - a logging failure must not stop training
            log.warning("W&B disabled for this run: wandb.init failed: %s", exc)
            self.run = None
            return
        earlier_events = read_jsonl(self.run_dir / EVENTS_FILE)
        earlier_metrics = read_jsonl(self.run_dir / METRICS_FILE)
        self._counts = count_events(e for e in earlier_events if e.get("time", self._t0) < self._t0)
        backfilled = self._backfill(earlier_metrics, previous) if previous is not None else 0
        if backfilled:
            log.info("W&B: logged %d metrics.jsonl records an earlier segment had not flushed", backfilled)
        if self.mode == "online":
            log.info("W&B run %s (online): %s", self.run_id, self.run.url)
        else:
            log.info("W&B run %s (offline): %s; upload later with: %s", self.run_id, self.run_dir / "wandb",
                     sync_command(self.run_dir, self.run_id))

    @property
    def active(self) -> bool:
        return self.run is not None and not self._finished

    def _backfill(self, metrics: list[dict[str, Any]], previous: OfflineRun) -> int:
        """Log the metrics.jsonl records that earlier segments wrote but never got into their W&B files.

        A worker killed by a fault or a resize takes wandb-core with it before it flushed its last rows (seen:
        the last ~10 rows of a killed segment missing). metrics.jsonl is the durable record: every record from
        before this process started and newer than the newest row in the earlier W&B files (`previous`) is logged
        now, before this segment's own rows, so the W&B history matches metrics.jsonl. Needs the records' "time"
        field.
        """
        earlier = [r for r in metrics if isinstance(r.get("time"), (int, float)) and r["time"] < self._t0 and "step" in r]
        logged = [row["time"] for row in previous.history if isinstance(row.get("time"), (int, float)) and "step" in row]
        newest = max(logged, default=None)
        # 1 us slack: the time went through JSON twice (ours, then W&B's) and must not be logged twice.
        missing = [r for r in earlier if newest is None or r["time"] > newest + 1e-6]
        for record in missing:
            self.run.log(metrics_row(record["step"], record))
        return len(missing)

    def _keep_files_in_run_dir(self) -> None:
        # wandb otherwise writes ~/.cache/wandb, ~/.local/share/wandb and ~/.config/wandb; a user's own setting wins.
        # Online, ~/.config/wandb stays: it holds the user's login host (`wandb login --host`) and default entity.
        base = self.run_dir / "wandb"
        dirs = [("WANDB_CACHE_DIR", ".cache"), ("WANDB_DATA_DIR", ".data")]
        if self.mode != "online":
            dirs.append(("WANDB_CONFIG_DIR", ".config"))
        for var, sub in dirs:
            if not os.environ.get(var):
                os.environ[var] = str(base / sub)

    def _avoid_same_second_dir(self) -> None:
        # Offline directories are named offline-run-<YYYYmmdd_HHMMSS>-<id>: a restart within the same second
        # would write into the previous segment's directory and overwrite its history.
        base = self.run_dir / "wandb"
        for _ in range(3):
            now_local = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
            now_utc = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M%S")
            if not any((base / f"offline-run-{t}-{self.run_id}").exists() for t in (now_local, now_utc)):
                return
            time.sleep(1.0 - (time.time() % 1.0) + 0.01)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One metrics.jsonl record as a W&B history row (see `metrics_row` for the mapping)."""
        if not self.active:
            return
        self.run.log(metrics_row(step, metrics))

    def log_event(self, event: Mapping[str, Any]) -> None:
        """One events.jsonl record: a running count in the history, an alert when online, a row of the table."""
        if not self.active:
            return
        event = dict(event)
        self._events.append(event)
        counter = event_counter(event)
        # Events from before this process started were counted from events.jsonl at init.
        already_counted = isinstance(event.get("time"), (int, float)) and event["time"] < self._t0
        if counter is not None:
            if not already_counted:
                self._counts[counter] = self._counts.get(counter, 0) + 1
            if self._counts.get(counter):
                self.run.log({"step": int(event.get("step") or 0), f"events/{counter}": self._counts[counter]})
        if event.get("event") == "profile":
            # where the profiled steps' time went (train.profile_from_step), one summary value per category: runs
            # side by side in W&B's table (an FP8 run's casts against a BF16 run's GEMMs)
            self.run.summary.update({"profile/wall_ms": event.get("wall_ms_per_step"),
                                     **{f"profile/{c}_ms": ms for c, ms in event.get("ms_per_step", {}).items()}})
        alert = alert_for(event)
        if alert is not None and self.mode == "online" and not already_counted:
            import wandb

            try:
                self.run.alert(title=alert[0][:63], text=alert[1], level=wandb.AlertLevel.WARN, wait_duration=0)
            except Exception as exc:  # noqa: BLE001 - alerts are a convenience; never fail the step for one
                log.warning("W&B alert failed: %s", exc)

    def _read_events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / EVENTS_FILE)

    def _event_rows(self) -> list[list[Any]]:
        # events.jsonl holds every segment's events (this process only saw its own): prefer it when present.
        events = self._read_events() or self._events
        return [event_table_row(e) for e in events]

    def finish(self, summary: Mapping[str, Any] | None = None) -> None:
        """Log the events table and the summary, then close the run (exit code 1 unless status is completed)."""
        if not self.active:
            return
        import wandb

        summary = dict(summary or {})
        try:
            rows = self._event_rows()
            if rows:
                with _tempdir_in(self._tmp_dir):  # the table is staged in a temp dir
                    self.run.log({"events": wandb.Table(columns=EVENT_TABLE_COLUMNS, data=rows)})
            clean = scrub_secrets(summary)
            self.run.summary.update({k: v for k, v in clean.items() if v is not None})
        finally:
            self._finished = True
            sync_file = self._sync_file()
            self.run.finish(exit_code=0 if summary.get("status") in OK_STATUSES else 1)
            if sync_file is not None:
                wait_until_flushed(sync_file)

    def _sync_file(self) -> Path | None:
        try:
            return Path(self.run.settings.sync_file)
        except Exception:  # noqa: BLE001 - attribute moved in another wandb version: skip the wait
            return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.active:
            self.finish({"status": "failed" if exc is not None else None})
