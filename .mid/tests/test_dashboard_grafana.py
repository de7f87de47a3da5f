"""deploy/grafana/elastic-fp8.json: every query names metrics the job exports (the names come from
observability/ray_metrics.py, the code that defines them), covers the panels the docs promise, and is PromQL a real
Prometheus accepts; the dashboard's own structure is sound (unique ids, no overlapping panels, defined variables)."""

from __future__ import annotations

import json
import re
import urllib.error
from pathlib import Path

import pytest

from orchestration.observability import ray_metrics as rm
from orchestration.observability.prometheus import Prometheus, prometheus_config
from tests.spawned import free_port

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "elastic-fp8.json"
METRIC_RE = re.compile(r"\bray_elastic_fp8_[a-z0-9_]+")
# What each panel must show (docs/deploy.md lists the panels): title -> metrics it must query.
REQUIRED = {
    "Loss and eval loss": {"loss", "eval_loss"},
    "Throughput and MFU": {"tokens_per_s", "mfu"},
    "World size and restarts": {"world_size", "restarts_total"},
    "Precision, fallbacks and rollbacks": {"precision_fp8", "fallbacks_total", "rollbacks_total"},
    "Checkpoint stall": {"checkpoint_stall_s"},
    "FP8 saturation and underflow": {"fp8_saturated_frac", "fp8_underflow_frac"},
}


def exported_names() -> set[str]:
    """Prometheus names of what TrainingMetrics exports: Ray prefixes "ray_", Prometheus suffixes counters "_total"."""
    gauges = {f"ray_{rm.PREFIX}{name}" for name in rm.GAUGES}
    counters = {f"ray_{rm.PREFIX}{name}_total" for name in rm.COUNTERS}
    return gauges | counters


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every annotation query."""
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [(f"annotation {a['name']}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return out


def test_every_query_names_only_exported_metrics(dashboard):
    exported = exported_names()
    assert len(exported) == len(rm.GAUGES) + len(rm.COUNTERS)
    for where, expr in queries(dashboard):
        names = set(METRIC_RE.findall(expr))
        assert names, f"{where}: {expr!r} queries no elastic_fp8 metric"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} are not exported by observability/ray_metrics.py"
        assert 'run=~"$run"' in expr, f"{where}: {expr!r} ignores the run selector"


def test_panels_cover_what_the_docs_promise(dashboard):
    by_title = {p["title"]: {m.removeprefix("ray_elastic_fp8_") for t in p["targets"]
                             for m in METRIC_RE.findall(t["expr"])} for p in dashboard["panels"]}
    for title, needed in REQUIRED.items():
        assert title in by_title, f"no panel {title!r}"
        assert needed <= by_title[title], (title, needed - by_title[title])
    marked = {a["name"] for a in dashboard["annotations"]["list"] if "expr" in a}
    assert {"Restarts", "Fallbacks", "Rollbacks"} <= marked


def test_structure(dashboard):
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40  # Grafana's uid limit
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    text = json.dumps(dashboard)
    used = set(re.findall(r"\$\{?([A-Za-z_]+)", text)) - {"__rate_interval", "__all"}
    assert used <= variables, used - variables
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]  # Grafana's grid is 24 columns wide
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        assert p["datasource"]["uid"] == "${datasource}"
    assert text.isascii()


def test_queries_parse_in_a_real_prometheus(tmp_path, dashboard):
    """Prometheus answers 400 for PromQL it cannot parse; Grafana's variables are filled as Grafana would."""
    with Prometheus(tmp_path / "no_targets.json", tmp_path / "prom", port=free_port()) as prom:
        prom.wait_ready()
        for where, expr in queries(dashboard):
            filled = expr.replace("$__rate_interval", "1m").replace("$run", ".*")
            try:
                prom.query(filled)
            except urllib.error.HTTPError as exc:
                pytest.fail(f"{where}: Prometheus rejects {filled!r}: {exc.read().decode()[:300]}")


def test_prometheus_config():
    text = prometheus_config(Path("/tmp/ray/prom_metrics_service_discovery.json"), scrape_interval_s=2.5)
    config = json.loads(text)
    assert config["global"]["scrape_interval"] == "2500ms"
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == [
        "/tmp/ray/prom_metrics_service_discovery.json"]
    with pytest.raises(ValueError, match="must be > 0"):
        prometheus_config(Path("x.json"), scrape_interval_s=0)


def test_kuberay_heads_point_the_dashboard_at_prometheus_and_grafana():
    import yaml

    from orchestration.observability.dashboard import MONITORING_ENV_KEYS

    kuberay = REPO / "deploy" / "kuberay"
    names = []
    for manifest in ("raycluster-nvidia.yaml", "raycluster-amd.yaml"):
        cluster = yaml.safe_load((kuberay / manifest).read_text())
        names.append(cluster["metadata"]["name"])
        (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in head["env"]}
        assert {"RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"} <= set(env), manifest
        assert set(env) <= set(MONITORING_ENV_KEYS), manifest
        assert all(v.startswith("http://") for v in env.values())
    (monitor,) = yaml.safe_load_all((kuberay / "monitoring.yaml").read_text())
    assert monitor["kind"] == "PodMonitor"
    (selector,) = monitor["spec"]["selector"]["matchExpressions"]
    assert selector["key"] == "ray.io/cluster" and sorted(selector["values"]) == sorted(names)
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
