"""Training metrics exported through ray.util.metrics, so they show in the Ray dashboard (Metrics tab / Grafana).

Every node's Ray metrics agent serves them on its Prometheus endpoint (`node_metrics_url()`); Ray prepends "ray_"
and Prometheus appends "_total" to counters, so `TrainingMetrics(...).update({"loss": 2.1})` appears as
`ray_elastic_fp8_loss{...} 2.1` and `.count("rollbacks")` as `ray_elastic_fp8_rollbacks_total{...} 1`.
They reach the endpoint about one export interval (`metrics_report_interval_ms`, 10 s by default) after being set.

Gauges (last value): step, loss, lr, grad_norm, tokens_per_s (global), tokens_per_s_per_device, mfu (0..1),
gpu_mem_peak_gib (rank 0, GPUs only), world_size, grad_accum, precision_fp8 (1 fp8, 0 bf16, 0.5 partly fallen
back), samples_consumed, eval_loss, fp8_saturated_frac and fp8_underflow_frac (rank 0, while in FP8), and timings
checkpoint_stall_s, checkpoint_save_s, checkpoint_load_s, restart_downtime_s, restart_setup_s.
deploy/grafana/elastic-fp8.json charts them; tests/test_dashboard_grafana.py checks its queries against these names.
Counters: divergences, fallbacks, rollbacks, restarts, workers_lost, checkpoints_saved, steps_skipped (or any
name given to `count`).

`TrainingMetrics` needs a Ray worker or driver process (ray.is_initialized()); elsewhere (torchrun, unit tests)
it is a no-op. Ray is imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "elastic_fp8_"

GAUGES: dict[str, str] = {
    "step": "Optimizer step of the last logged step",
    "loss": "Training loss (LM loss) of the last logged step",
    "eval_loss": "Loss on the held-out eval split at the last evaluation",
    "lr": "Learning rate",
    "grad_norm": "Global gradient norm before clipping",
    "tokens_per_s": "Training throughput, tokens per second over all workers",
    "tokens_per_s_per_device": "Training throughput per worker",
    "mfu": "Model FLOPs utilization (0..1) against the device's dense peak in the running precision",
    "gpu_mem_peak_gib": "Peak GPU memory allocated by rank 0 so far, GiB (torch.cuda.max_memory_allocated)",
    "world_size": "Number of training workers",
    "grad_accum": "Gradient accumulation steps (recomputed at each (re)start)",
    "precision_fp8": "Precision state: 1 all FP8, 0 BF16, 0.5 partly fallen back",
    "samples_consumed": "Training samples consumed so far",
    "fp8_saturated_frac": "Mean over FP8 layers of the sampled FP8 values at +-max (rank 0)",
    "fp8_underflow_frac": "Mean over FP8 layers of the sampled nonzero inputs cast to zero (rank 0)",
    "checkpoint_stall_s": "Seconds training stood still for the last checkpoint save (background: the host copy)",
    "checkpoint_save_s": "Seconds the last checkpoint save took",
    "checkpoint_load_s": "Seconds the last checkpoint load took (at a restart)",
    "restart_downtime_s": "Seconds from the last worker group's last step to the new group's first",
    "restart_setup_s": "Seconds the last restart spent in setup (process groups, model, optimizer)",
}
COUNTERS: dict[str, str] = {
    "divergences": "Divergence verdicts (any detector, any rank)",
    "fallbacks": "FP8 -> BF16 fallbacks",
    "rollbacks": "Rollbacks to an earlier good checkpoint",
    "restarts": "Worker group restarts (failures and resizes)",
    "workers_lost": "Workers lost",
    "checkpoints_saved": "Checkpoints saved",
    "steps_skipped": "Optimizer steps skipped (non-finite gradients)",
}
# metrics.jsonl keys that are not gauges of their own
_IGNORED_KEYS = frozenset({"time", "elapsed_s", "consumed_ranges", "skipped_ranges"})
_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]*$")


def precision_code(precision: Any) -> float | None:
    """Precision as a number: fp8 1.0, bf16 0.0, anything mixed/partial 0.5, None unknown."""
    if precision is None:
        return None
    p = str(precision).lower()
    if p == "fp8":
        return 1.0
    if p in ("bf16", "bfloat16"):
        return 0.0
    return 0.5


def gauge_values(step_metrics: Mapping[str, Any]) -> dict[str, float]:
    """The gauge name -> value pairs one metrics record sets (pure; what `TrainingMetrics.update` exports).

    None values are skipped (MFU on CPU); NaN/inf are exported as they are (a NaN loss must be visible);
    "precision" becomes precision_fp8; other strings and unknown non-numbers are skipped.
    """
    out: dict[str, float] = {}
    for key, value in step_metrics.items():
        if key in _IGNORED_KEYS or value is None:
            continue
        if key == "precision":
            code = precision_code(value)
            if code is not None:
                out["precision_fp8"] = code
            continue
        if hasattr(value, "item") and not isinstance(value, (int, float)):
            value = value.item()
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)):
            continue
        name = re.sub(r"[^a-z0-9_]", "_", str(key).lower())
        if name and _NAME_RE.match(name):
            out[name] = float(value)
    return out


def event_metrics(event: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, float]]:
    """(counter increments, gauge values) for one events.jsonl record (pure)."""
    name = event.get("event")
    counts: dict[str, int] = {}
    gauges: dict[str, float] = {}

    def num(key: str) -> float | None:
        v = event.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    if name == "divergence_detected":
        counts["divergences"] = 1
    elif name == "precision_changed" and str(event.get("to")).lower() == "bf16":
        counts["fallbacks"] = 1
        # scope None / "model" is the whole model; a list of module prefixes is a partial fallback
        gauges["precision_fp8"] = 0.0 if event.get("scope") in (None, "", "model") else 0.5
    elif name == "precision_changed" and str(event.get("to")).lower() == "fp8":
        gauges["precision_fp8"] = 1.0
    elif name == "rollback":
        counts["rollbacks"] = 1
    elif name == "worker_lost":
        counts["workers_lost"] = 1
    elif name == "step_skipped":
        counts["steps_skipped"] = 1
    elif name == "checkpoint_saved":
        counts["checkpoints_saved"] = 1
        for key in ("seconds", "save_s", "duration_s"):
            if num(key) is not None:
                gauges["checkpoint_save_s"] = num(key)
                break
    elif name == "checkpoint_timing":
        if num("seconds") is not None:
            gauges["checkpoint_stall_s"] = num("seconds")
        # a background save's whole write took background_s; a synchronous save's is its stall
        total = num("background_s") if event.get("background") else num("seconds")
        if total is not None:
            gauges["checkpoint_save_s"] = total
    elif name == "resume":
        counts["restarts"] = 1
        for src, dst in (("downtime_s", "restart_downtime_s"), ("setup_s", "restart_setup_s"),
                         ("checkpoint_load_s", "checkpoint_load_s"), ("world_size", "world_size")):
            if num(src) is not None:
                gauges[dst] = num(src)
    elif name == "worker_group_start":
        for key in ("world_size", "grad_accum"):
            if num(key) is not None:
                gauges[key] = num(key)
    return counts, gauges


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"metric name {name!r} must match [a-z_][a-z0-9_]* (it is exported as "
                         f"ray_{PREFIX}<name>)")
    return name


class TrainingMetrics:
    """Ray Gauges/Counters for the training loop, tagged with `tags` (e.g. run, model, precision, rank).

    Create once per worker process (Ray metric objects are cheap but registering them per step is not).
    """

    def __init__(self, tags: Mapping[str, Any]):
        for key in tags:
            _check_name(str(key))
        self.tags = {str(k): str(v) for k, v in tags.items()}
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        try:
            import ray

            self.enabled = ray.is_initialized()
        except ImportError:
            self.enabled = False
        if not self.enabled:
            log.info("Ray metrics off: not inside a Ray process")

    def _metric(self, kind: str, name: str) -> Any:
        from ray.util import metrics as ray_metrics

        table = self._gauges if kind == "gauge" else self._counters
        if name not in table:
            described = GAUGES if kind == "gauge" else COUNTERS
            cls = ray_metrics.Gauge if kind == "gauge" else ray_metrics.Counter
            metric = cls(PREFIX + name, description=described.get(name, name.replace("_", " ")),
                         tag_keys=tuple(sorted(self.tags)))
            metric.set_default_tags(self.tags)
            table[name] = metric
        return table[name]

    def set(self, name: str, value: float) -> None:
        """One gauge."""
        _check_name(name)
        if not self.enabled or value is None:
            return
        self._metric("gauge", name).set(float(value))

    def update(self, step_metrics: Mapping[str, Any]) -> None:
        """Gauges from one metrics.jsonl-style record (see `gauge_values`)."""
        if not self.enabled:
            return
        for name, value in gauge_values(step_metrics).items():
            self._metric("gauge", name).set(value)
        ws = step_metrics.get("world_size")
        tps = step_metrics.get("tokens_per_s")
        if isinstance(ws, (int, float)) and ws and isinstance(tps, (int, float)) and math.isfinite(tps):
            self._metric("gauge", "tokens_per_s_per_device").set(float(tps) / float(ws))

    def count(self, name: str, n: float = 1) -> None:
        """Add n (> 0) to a counter."""
        _check_name(name)
        if n < 0:
            raise ValueError(f"counter {name!r} can only grow; got n={n}")
        if not self.enabled or n == 0:
            return
        self._metric("counter", name).inc(n)

    def record_event(self, event: Mapping[str, Any]) -> None:
        """Counters and timing gauges from one events.jsonl record (see `event_metrics`)."""
        if not self.enabled:
            return
        counts, gauges = event_metrics(event)
        for name, n in counts.items():
            self.count(name, n)
        for name, value in gauges.items():
            self._metric("gauge", name).set(value)


def dashboard_url(context: Any = None) -> str | None:
    """The Ray dashboard URL (with http://) of the cluster this driver is connected to; None without one.

    `context` is what ray.init() returned, if the caller has it; otherwise the connected node is asked.
    """
    url = getattr(context, "dashboard_url", None) if context is not None else None
    if not url:
        url = os.environ.get("RAY_OVERRIDE_DASHBOARD_URL")
    if not url:
        try:
            import ray

            if not ray.is_initialized():
                return None
            # ray.init(...).dashboard_url reads the same field; the node object is how to reach it later.
            url = ray._private.worker._global_node.webui_url
        except Exception:  # noqa: BLE001 - private Ray API: a missing URL is not worth an error
            return None
    if not url:
        return None
    return url if "://" in url else f"http://{url}"


def node_metrics_url() -> str | None:
    """http://<ip>:<port>/metrics of this node's Prometheus endpoint (driver side; None if unknown)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        node = ray._private.worker.global_worker.node
        return f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    except Exception:  # noqa: BLE001 - private Ray API: a missing URL is not worth an error
        return None
