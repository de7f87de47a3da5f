"""The autoscaled cluster the elastic tests run on (orchestration/driver/autoscale_local.py) is the one the project
ships for the clouds, on CPU: the same node types by role (a head without training resources, one on-demand type that
is the elastic range's floor, one spot type that is its growth), the same autoscaler settings, and the spot groups of
the KubeRay manifests turn a pod's termination into the drain the tests give notice with. Pure: no Ray cluster."""

from __future__ import annotations

import time

import pytest
import yaml

from orchestration.driver import autoscale_local as al
from orchestration.training import departure
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
LAUNCHERS = sorted((DEPLOY / "ray").glob("*.yaml"))
RAYCLUSTERS = sorted((DEPLOY / "kuberay").glob("raycluster-*.yaml"))


def load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def roles(types: dict, head_type: str, separator: str = "_") -> dict[str, list[str]]:
    """Node type names by role, from their names' last part: ondemand (the floor) and spot (the growth)."""
    by_role: dict[str, list[str]] = {"head": [head_type], "ondemand": [], "spot": [], "other": []}
    for name in types:
        if name == head_type:
            continue
        role = name.rsplit(separator, 1)[-1]
        by_role[role if role in ("ondemand", "spot") else "other"].append(name)
    return by_role


def test_the_fake_cluster_has_the_cloud_node_roles():
    config = al.autoscaler_config(gcs_port=6390, spot_nodes=3)
    types = config["available_node_types"]
    by_role = roles(types, config["head_node_type"])
    assert by_role == {"head": [al.HEAD_TYPE], "ondemand": [al.ONDEMAND_TYPE], "spot": [al.SPOT_TYPE], "other": []}
    assert types[al.HEAD_TYPE]["resources"] == {"CPU": 0}  # no training worker lands on the head
    assert types[al.ONDEMAND_TYPE]["min_workers"] == types[al.ONDEMAND_TYPE]["max_workers"] == 1
    assert (types[al.SPOT_TYPE]["min_workers"], types[al.SPOT_TYPE]["max_workers"]) == (0, 3)
    assert config["max_workers"] == 4
    assert config["provider"]["gcs_address"] == "127.0.0.1:6390"
    # each node carries its type as a label (the dashboard's Cluster page, LocalAutoscalingCluster.alive)
    assert all(types[t]["labels"] == {al.NODE_TYPE_LABEL: t} for t in (al.ONDEMAND_TYPE, al.SPOT_TYPE))


def test_the_fake_cluster_config_validates_against_the_ray_schema():
    from ray.autoscaler._private.util import validate_config

    validate_config(al.autoscaler_config(gcs_port=6390, spot_nodes=1))


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_node_types_are_the_fake_clusters(path):
    """Same roles and names by role; same upscaling speed. The idle timeout differs on purpose: minutes for a GPU
    VM (a start costs minutes), seconds here."""
    config = load(path)
    types = config["available_node_types"]
    by_role = roles(types, config["head_node_type"])
    assert len(by_role["ondemand"]) == 1 and len(by_role["spot"]) == 1 and not by_role["other"], by_role
    (ondemand,), (spot,) = by_role["ondemand"], by_role["spot"]
    # The same accelerator prefix for both, as cpu_ondemand / cpu_spot.
    assert ondemand.rsplit("_", 1)[0] == spot.rsplit("_", 1)[0]
    assert types[ondemand]["min_workers"] == types[ondemand]["max_workers"] >= 1
    assert types[spot]["min_workers"] == 0 < types[spot]["max_workers"]
    assert types[ondemand]["resources"] == types[spot]["resources"]  # one node shape, as in the fake cluster
    assert config["upscaling_speed"] == al.autoscaler_config(6390, 1)["upscaling_speed"]
    assert config["idle_timeout_minutes"] > 0


@pytest.mark.parametrize("path", RAYCLUSTERS, ids=lambda p: p.name)
def test_raycluster_groups_are_the_fake_clusters_and_spot_pods_drain_before_they_go(path):
    spec = load(path)["spec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    by_role = roles(groups, head_type="", separator="-")
    by_role.pop("head")
    assert len(by_role["ondemand"]) == 1 and len(by_role["spot"]) == 1 and not by_role["other"], by_role
    (ondemand,), (spot,) = by_role["ondemand"], by_role["spot"]
    assert groups[ondemand]["minReplicas"] == groups[ondemand]["maxReplicas"] >= 1
    assert groups[spot]["minReplicas"] == 0 < groups[spot]["maxReplicas"]
    assert spec["enableInTreeAutoscaling"] is True
    # The spot pod's preStop hook: a drain with a deadline inside the grace period, then it waits that long.
    pod = groups[spot]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert "ray drain-node --reason=DRAIN_NODE_REASON_PREEMPTION" in command
    deadline = int(command.split("--deadline-remaining-seconds=")[1].split(";")[0])
    assert command.endswith(f"sleep {deadline}")
    assert deadline < pod["terminationGracePeriodSeconds"]


def test_the_autoscale_local_preset_spans_the_fake_clusters_nodes():
    """conf/cluster/autoscale_local.yaml: the floor is the on-demand node, the ceiling adds the default spot node;
    one worker per node; it joins the cluster `autoscale_local up` starts."""
    from orchestration.config import ClusterConfig

    preset = load(REPO / "conf" / "cluster" / "autoscale_local.yaml")
    types = al.node_types(spot_nodes=1)
    per_node = types[al.ONDEMAND_TYPE]["resources"]["CPU"] / preset.get("cpus_per_worker", ClusterConfig.cpus_per_worker)
    assert preset["min_workers"] == types[al.ONDEMAND_TYPE]["min_workers"] * per_node
    assert preset["max_workers"] == (types[al.ONDEMAND_TYPE]["max_workers"] + types[al.SPOT_TYPE]["max_workers"]) \
        * per_node
    assert preset["address"] == f"127.0.0.1:{al.DEFAULT_PORT}"
    assert preset["device"] == "cpu" and preset["gpus_per_worker"] == 0


def test_ports_are_picked_free_and_below_the_ephemeral_range_and_again_for_each_try(tmp_path, monkeypatch):
    """Outgoing connections take their local ports from the ephemeral range: a listener's port picked there may be
    taken before `ray start` binds it. Given ports are kept on every try."""
    import socket

    low, high = al.ephemeral_ports()
    assert al.PORT_FLOOR < low <= high
    ports = {al.free_port() for _ in range(20)}
    assert all(al.PORT_FLOOR <= port < low for port in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free: it binds
    def ports_of_two_failed_tries(cluster: al.LocalAutoscalingCluster) -> list[tuple[int, str]]:
        tries = []

        def failing_start(timeout_s: float) -> al.LocalAutoscalingCluster:
            tries.append((cluster.port, cluster.dashboard_url))
            raise TimeoutError("the on-demand node was not up")

        monkeypatch.setattr(cluster, "_start_once", failing_start)
        with pytest.raises(TimeoutError):
            cluster.start(attempts=2)
        return tries

    picked = al.LocalAutoscalingCluster(tmp_path, spot_nodes=0)
    first = (picked.port, picked.dashboard_url)
    tries = ports_of_two_failed_tries(picked)
    assert tries[0] == first and tries[1][0] != first[0] and tries[1][1] != first[1]
    given = al.LocalAutoscalingCluster(tmp_path, spot_nodes=0, port=23456, dashboard_port=23457)
    assert ports_of_two_failed_tries(given) == [(23456, "http://127.0.0.1:23457")] * 2


def test_a_node_record_of_the_state_api_gives_its_type():
    record = {"node_id": "ab" * 28, "state": "ALIVE", "labels": {al.NODE_TYPE_LABEL: al.SPOT_TYPE},
              "start_time_ms": 1_700_000_000_500, "is_head_node": False}
    node = al.Node.from_state_api(record)
    assert (node.node_type, node.alive, node.start_time_s) == (al.SPOT_TYPE, True, 1_700_000_000.5)
    head = al.Node.from_state_api({"node_id": "cd" * 28, "state": "DEAD", "labels": {}, "is_head_node": True})
    assert (head.node_type, head.alive, head.start_time_s) == (al.HEAD_TYPE, False, None)


def test_outside_a_ray_train_worker_there_is_no_notice_and_a_driver_stop_is_not_one():
    assert departure.notice_info() is None
    # rank 0, one process, the driver asked to stop: no notice, at once (no wait for one)
    t0 = time.time()
    assert departure.agreed_notice(rank=0, driver_asked_stop=True) is None
    assert time.time() - t0 < 1


def test_the_wait_for_a_leaving_node_ends_in_an_error_when_the_group_is_not_ended():
    t0 = time.time()
    with pytest.raises(RuntimeError, match="announced to leave, but the worker group was not ended"):
        departure.wait_for_the_node_to_go({"nodes": ["n1"], "ranks": [1], "deadline": t0 + 0.5}, margin_s=0.5)
    assert 1.0 <= time.time() - t0 < 3
