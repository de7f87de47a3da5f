"""Ray metrics: values set from a Ray actor reach the local node's Prometheus endpoint; pure mappings."""

import math
import os
import shutil
import tempfile
import time
import urllib.request

import pytest

from orchestration.observability import ray_metrics as rm

RUN_TAGS = {"run": "unit-run", "model": "debug_moe", "rank": "0"}


# ------------------------------------------------------------------------------------------------ pure mappings


def test_gauge_values_from_metrics_record():
    rec = {"step": 12, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 800.0, "world_size": 2,
           "precision": "bf16", "mfu": None, "time": 1.7e9, "samples_consumed": 96, "note": "x"}
    got = rm.gauge_values(rec)
    assert got == {"step": 12.0, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 800.0,
                   "world_size": 2.0, "precision_fp8": 0.0, "samples_consumed": 96.0}
    assert math.isnan(rm.gauge_values({"loss": float("nan")})["loss"])
    assert rm.gauge_values({"precision": "fp8"}) == {"precision_fp8": 1.0}
    assert rm.gauge_values({"precision": "mixed"}) == {"precision_fp8": 0.5}


def test_event_metrics():
    assert rm.event_metrics({"event": "divergence_detected", "rank": 1}) == ({"divergences": 1}, {})
    assert rm.event_metrics({"event": "precision_changed", "from": "fp8", "to": "bf16", "scope": None}) == (
        {"fallbacks": 1}, {"precision_fp8": 0.0})
    assert rm.event_metrics({"event": "precision_changed", "to": "bf16", "scope": "model"})[1] == {
        "precision_fp8": 0.0}
    assert rm.event_metrics({"event": "precision_changed", "to": "bf16", "scope": ["layers.3"]})[1] == {
        "precision_fp8": 0.5}
    assert rm.event_metrics({"event": "rollback", "to_step": 3}) == ({"rollbacks": 1}, {})
    assert rm.event_metrics({"event": "checkpoint_saved", "seconds": 1.25}) == (
        {"checkpoints_saved": 1}, {"checkpoint_save_s": 1.25})
    assert rm.event_metrics({"event": "resume", "from_step": 40, "world_size": 1, "downtime_s": 44.0,
                             "setup_s": 3.0, "checkpoint_load_s": 0.5}) == (
        {"restarts": 1},
        {"restart_downtime_s": 44.0, "restart_setup_s": 3.0, "checkpoint_load_s": 0.5, "world_size": 1.0})
    assert rm.event_metrics({"event": "worker_group_start", "world_size": 2, "grad_accum": 4}) == (
        {}, {"world_size": 2.0, "grad_accum": 4.0})
    # The stall is what training waited; a background save's whole write is its thread's time.
    assert rm.event_metrics({"event": "checkpoint_timing", "seconds": 0.5, "state_s": 0.1}) == (
        {}, {"checkpoint_stall_s": 0.5, "checkpoint_save_s": 0.5})
    assert rm.event_metrics({"event": "checkpoint_timing", "checkpoint_step": 20, "background": True,
                             "seconds": 0.25, "background_s": 3.0}) == (
        {}, {"checkpoint_stall_s": 0.25, "checkpoint_save_s": 3.0})


def test_names_and_noop_outside_ray():
    with pytest.raises(ValueError, match="metric name"):
        rm.TrainingMetrics({"Bad-Key": "x"})
    m = rm.TrainingMetrics(RUN_TAGS)
    assert not m.enabled  # no ray.init in this test
    m.update({"loss": 1.0})
    m.count("rollbacks")
    with pytest.raises(ValueError, match="metric name"):
        m.count("not valid")
    with pytest.raises(ValueError, match="only grow"):
        m.count("rollbacks", -1)
    assert rm.dashboard_url() is None or os.environ.get("RAY_OVERRIDE_DASHBOARD_URL")


def test_dashboard_url_formats(monkeypatch):
    class Ctx:
        dashboard_url = "127.0.0.1:8265"

    assert rm.dashboard_url(Ctx()) == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_OVERRIDE_DASHBOARD_URL", "https://dash.example:443")
    assert rm.dashboard_url() == "https://dash.example:443"


# ------------------------------------------------------------------------------------------------ real local Ray


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """{(sample name, run tag): value} for our metrics on one Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_" + rm.PREFIX):
                out[(sample.name, sample.labels.get("run", ""), sample.labels.get("model", ""))] = sample.value
    return out


def test_metrics_reach_local_prometheus_endpoint(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # A short path: Ray's unix sockets live under the temp dir and must stay under 107 characters.
    temp_dir = tempfile.mkdtemp(prefix="rm_", dir="/tmp")
    try:
        ray.init(num_cpus=1, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
                 # export every second (default 10 s) so the test waits less
                 _system_config={"metrics_report_interval_ms": 1000})
        url = rm.node_metrics_url()
        assert url is not None and url.startswith("http://")
        assert rm.dashboard_url() is None  # started without a dashboard

        @ray.remote(num_cpus=0)
        class Worker:
            def run(self, tags):
                from orchestration.observability.ray_metrics import TrainingMetrics

                m = TrainingMetrics(tags)
                assert m.enabled
                m.update({"step": 7, "loss": 2.375, "tokens_per_s": 1200.0, "world_size": 2, "precision": "fp8",
                          "mfu": 0.125, "lr": 1e-3})
                m.record_event({"event": "precision_changed", "from": "fp8", "to": "bf16", "scope": None})
                m.record_event({"event": "checkpoint_saved", "seconds": 0.75})
                m.record_event({"event": "divergence_detected", "rank": 0})
                m.record_event({"event": "divergence_detected", "rank": 1})
                m.count("rollbacks", 3)
                return True

        worker = Worker.remote()
        assert ray.get(worker.run.remote(RUN_TAGS), timeout=60)

        expected = {
            "ray_elastic_fp8_loss": 2.375,
            "ray_elastic_fp8_step": 7.0,
            "ray_elastic_fp8_tokens_per_s": 1200.0,
            "ray_elastic_fp8_tokens_per_s_per_device": 600.0,
            "ray_elastic_fp8_world_size": 2.0,
            "ray_elastic_fp8_mfu": 0.125,
            "ray_elastic_fp8_precision_fp8": 0.0,  # the fallback event came after the fp8 record
            "ray_elastic_fp8_checkpoint_save_s": 0.75,
            "ray_elastic_fp8_fallbacks_total": 1.0,
            "ray_elastic_fp8_divergences_total": 2.0,
            "ray_elastic_fp8_rollbacks_total": 3.0,
            "ray_elastic_fp8_checkpoints_saved_total": 1.0,
        }
        deadline = time.monotonic() + 30
        got = {}
        while time.monotonic() < deadline:
            try:
                got = {name: v for (name, run, model), v in _scrape(url).items()
                       if run == "unit-run" and model == "debug_moe"}
            except OSError:
                got = {}
            if all(name in got for name in expected):
                break
            time.sleep(0.5)
        missing = sorted(set(expected) - set(got))
        assert not missing, f"not exported within 30 s: {missing}; got {got}"
        for name, value in expected.items():
            assert got[name] == pytest.approx(value), name
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
