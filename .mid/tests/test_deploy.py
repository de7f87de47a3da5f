"""deploy/ and conf/cluster/: launcher YAMLs valid for the installed Ray, KubeRay manifests complete, cluster presets
well-typed, and the elastic ranges of the three (conf, launcher, manifests) in step with each other.

No cloud is contacted: the checks are schema validation, parsing, and arithmetic over the files.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import jsonschema
import pyarrow.fs
import pytest
import yaml

from orchestration.config import DEVICES, ClusterConfig
from orchestration.driver.env_presets import ENV_PRESETS, resolve_worker_env
from orchestration.validation import check_preset_device

REPO = Path(__file__).resolve().parent.parent
CONF_CLUSTER = REPO / "conf" / "cluster"
DEPLOY = REPO / "deploy"

# launcher YAML -> the conf/cluster preset that runs on it, the URI scheme of its storage, how a node type is spot
LAUNCHERS = {
    "aws-h200.yaml": ("aws_h200", "s3://"),
    "gcp-a3.yaml": ("gcp_a3", "gs://"),
    "azure-mi300x.yaml": ("azure_mi300x", "abfss://"),
}
# RayCluster manifest -> (GPU resource name, the env preset its pod env must equal)
RAYCLUSTERS = {
    "raycluster-nvidia.yaml": ("nvidia.com/gpu", "nccl_h100"),
    "raycluster-amd.yaml": ("amd.com/gpu", "rccl_mi300x"),
}
SPOT_SELECTORS = {
    "cloud.google.com/gke-spot": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "kubernetes.azure.com/scalesetpriority": "spot",
}
CLUSTER_FIELDS = {
    "name": str, "address": (str, type(None)), "min_workers": int, "max_workers": int, "device": str,
    "cpus_per_worker": float, "gpus_per_worker": float, "memory_per_worker_gb": float,
    "storage_path": (str, type(None)), "env_preset": str, "env_vars": dict, "runtime_env": dict,
    "max_failures": int, "worker_group_start_timeout_s": float, "health_check_interval_s": float,
    "elastic_resize_interval_s": float, "fabric": str, "drain_poll_interval_s": float,
}


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def load_all(path: Path) -> list[dict]:
    with open(path) as f:
        return list(yaml.safe_load_all(f))


def cluster_conf(name: str) -> dict:
    """A cluster preset as a job gets it: its keys over the schema's defaults, the ones it leaves to the machine
    decided for a machine without GPUs (what this one is; a GPU machine would fill them from its GPUs)."""
    from omegaconf import OmegaConf

    from orchestration.config import JobConfig, to_dict
    from orchestration.machine_defaults import NO_GPU, resolve_cluster

    job = JobConfig()
    job.cluster = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig),
                                                      load(CONF_CLUSTER / f"{name}.yaml")))
    resolve_cluster(job, NO_GPU)
    return to_dict(job)["cluster"]


@pytest.fixture(scope="module")
def ray_schema() -> dict:
    import ray.autoscaler

    with open(Path(ray.autoscaler.__file__).parent / "ray-schema.json") as f:
        return json.load(f)


# ---------------------------------------------------------------- conf/cluster/*.yaml

CONF_FILES = sorted(CONF_CLUSTER.glob("*.yaml"))


def test_every_cluster_preset_is_covered():
    names = {p.stem for p in CONF_FILES}
    assert {"local", "existing", "kuberay", *(conf for conf, _ in LAUNCHERS.values())} <= names


@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: p.stem)
def test_cluster_conf_has_only_schema_keys_of_their_types(path):
    """A preset holds what differs from the schema's defaults (orchestration/config.py); resolved, it has them all."""
    conf = load(path)
    assert set(CLUSTER_FIELDS) == {f.name for f in dataclasses.fields(ClusterConfig)}, "update CLUSTER_FIELDS"
    assert set(conf) <= set(CLUSTER_FIELDS)
    resolved = cluster_conf(path.stem)
    assert set(resolved) == set(CLUSTER_FIELDS)
    for key, typ in CLUSTER_FIELDS.items():
        assert isinstance(resolved[key], typ), f"{path.name}: {key}={resolved[key]!r} is not {typ}"
    # and the structured schema itself accepts it (types, no unknown keys)
    from omegaconf import OmegaConf

    merged = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), conf))
    assert merged.name == path.stem


@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: p.stem)
def test_cluster_conf_values_are_sensible(path):
    c = cluster_conf(path.stem)
    assert 1 <= c["min_workers"] <= c["max_workers"]
    assert c["device"] in DEVICES
    if c["device"] in ("cuda", "rocm"):
        assert c["gpus_per_worker"] > 0
    if c["device"] == "cpu":
        assert c["gpus_per_worker"] == 0
    assert c["cpus_per_worker"] > 0 and c["memory_per_worker_gb"] > 0
    assert c["max_failures"] >= 0 and c["worker_group_start_timeout_s"] > 0 and c["health_check_interval_s"] > 0
    assert c["address"] is None or c["address"] == "auto" or ":" in c["address"]
    sp = c["storage_path"]
    assert sp is None or sp.startswith(("s3://", "gs://", "abfss://", "abfs://")) or os.path.isabs(sp)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in c["env_vars"].items())
    check_preset_device(c["env_preset"], c["device"])
    env = resolve_worker_env(c["env_preset"], c["env_vars"])
    assert set(ENV_PRESETS[c["env_preset"]]) <= set(env)


@pytest.mark.parametrize("path", [p for p in CONF_FILES if (load(p).get("storage_path") or "").count("://")],
                         ids=lambda p: p.stem)
def test_cloud_storage_uris_resolve_offline_through_pyarrow(path):
    # Ray Train hands storage_path to pyarrow.fs.FileSystem.from_uri. An s3:// URI without ?region= makes pyarrow
    # ask AWS for the bucket's region first (a network call that fails on a machine without one).
    uri = load(path)["storage_path"]
    if uri.startswith("s3://"):
        assert "region=" in uri, "add ?region=<bucket region> to the s3:// storage_path"
    fs, fs_path = pyarrow.fs.FileSystem.from_uri(uri)
    expected = {"s3": "S3FileSystem", "gs": "GcsFileSystem", "abfss": "AzureFileSystem", "abfs": "AzureFileSystem"}
    assert type(fs).__name__ == expected[uri.split("://")[0]]
    assert fs_path.endswith("elastic-fp8") and "?" not in fs_path


def test_existing_cluster_joins_by_address_and_leaves_its_shape_to_the_clusters_resources():
    raw = load(CONF_CLUSTER / "existing.yaml")
    assert raw["address"] == "auto"  # $RAY_ADDRESS, else the cluster `ray start --head` started on this machine
    # workers, device and memory come from Ray's node resources (orchestration/driver/machine.py)
    assert not {"min_workers", "max_workers", "device", "gpus_per_worker", "memory_per_worker_gb"} & set(raw)
    c = cluster_conf("existing")  # a cluster without GPUs: the CPU demo's 2 workers, 1 CPU each
    assert (c["device"], c["min_workers"], c["max_workers"], c["cpus_per_worker"]) == ("cpu", 2, 2, 1.0)


# ---------------------------------------------------------------- deploy/ray launcher YAMLs

@pytest.mark.parametrize("fname", sorted(LAUNCHERS))
def test_launcher_yaml_validates_against_the_ray_schema(fname, ray_schema):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(DEPLOY / "ray" / fname)
    jsonschema.validate(config, ray_schema)
    # What `ray up` itself does before touching the cloud: merge provider defaults, then validate.
    validate_config(prepare_config(copy.deepcopy(config)))


def test_the_schema_check_can_fail(ray_schema):
    config = load(DEPLOY / "ray" / "aws-h200.yaml")
    bad_key = copy.deepcopy(config)
    bad_key["min_workers_typo"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_key, ray_schema)
    bad_resource = copy.deepcopy(config)
    bad_resource["available_node_types"]["gpu_spot"]["resources"]["GPU"] = 0.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_resource, ray_schema)


def _is_spot(provider: str, node_config: dict) -> bool:
    if provider == "aws":
        return node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    if provider == "gcp":
        sched = node_config.get("scheduling", {})
        return sched.get("provisioningModel") == "SPOT" or sched.get("preemptible") is True
    if provider == "azure":
        return node_config.get("azure_arm_parameters", {}).get("priority") == "Spot"
    raise AssertionError(provider)


@pytest.mark.parametrize("fname", sorted(LAUNCHERS))
def test_launcher_elastic_range_matches_its_cluster_preset(fname):
    config = load(DEPLOY / "ray" / fname)
    conf_name, scheme = LAUNCHERS[fname]
    c = cluster_conf(conf_name)
    provider = config["provider"]["type"]
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "training workers must not land on the head"
    gpu_types = {k: v for k, v in types.items() if v["resources"].get("GPU", 0) > 0}
    assert gpu_types

    def workers(node_type: dict, count: int) -> float:
        return count * node_type["resources"]["GPU"] / c["gpus_per_worker"]

    floor = sum(workers(t, t.get("min_workers", 0)) for t in gpu_types.values())
    ceiling = sum(workers(t, t["max_workers"]) for t in gpu_types.values())
    assert (floor, ceiling) == (c["min_workers"], c["max_workers"])
    assert config["max_workers"] == sum(t["max_workers"] for t in gpu_types.values())
    # The floor is on-demand (it must survive a spot reclaim); the growth is spot, where elasticity pays.
    spot = {k: t for k, t in gpu_types.items() if _is_spot(provider, t["node_config"])}
    ondemand = {k: t for k, t in gpu_types.items() if k not in spot}
    assert spot and ondemand
    assert all(t.get("min_workers", 0) == 0 for t in spot.values())
    assert sum(workers(t, t["min_workers"]) for t in ondemand.values()) == c["min_workers"]
    for t in gpu_types.values():  # the preset's CPU share per worker fits the node
        assert c["cpus_per_worker"] * t["resources"]["GPU"] / c["gpus_per_worker"] <= t["resources"]["CPU"]
    assert c["storage_path"].startswith(scheme)
    assert c["device"] == ("rocm" if "mi300x" in fname else "cuda")


@pytest.mark.parametrize("fname", sorted(LAUNCHERS))
def test_launcher_installs_the_project_on_every_node(fname):
    config = load(DEPLOY / "ray" / fname)
    remote = "/home/ubuntu/elastic-fp8"
    assert config["file_mounts"] == {remote: "."}  # `ray up` from the repository root
    assert ".venv" in config["rsync_exclude"] and "runs" in config["rsync_exclude"]
    setup = " && ".join(config["setup_commands"])
    assert "pip install -q -e ~/elastic-fp8" in setup
    for cmd in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        if "ray " in cmd:
            assert "~/venv/bin/ray" in cmd, "start Ray from the venv that holds the project"
    assert any("--head" in cmd and "--autoscaling-config" in cmd for cmd in config["head_start_ray_commands"])
    assert any("--address=$RAY_HEAD_IP:6379" in cmd for cmd in config["worker_start_ray_commands"])
    if "mi300x" in fname:  # ROCm torch before the project, or pip pulls the CUDA build from PyPI
        rocm = next(i for i, cmd in enumerate(config["setup_commands"]) if "whl/rocm" in cmd)
        project = next(i for i, cmd in enumerate(config["setup_commands"]) if "-e ~/elastic-fp8" in cmd)
        assert rocm < project


def test_aws_workers_get_the_instance_profile_for_s3():
    types = load(DEPLOY / "ray" / "aws-h200.yaml")["available_node_types"]
    for name, t in types.items():
        if t["resources"].get("GPU", 0) > 0:
            assert t["node_config"]["IamInstanceProfile"] == {"Name": "ray-autoscaler-v1"}, name


# ---------------------------------------------------------------- deploy/kuberay manifests

def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


@pytest.mark.parametrize("fname", sorted(RAYCLUSTERS))
def test_raycluster_manifest_has_the_required_fields(fname):
    docs = load_all(DEPLOY / "kuberay" / fname)
    assert len(docs) == 1
    rc = docs[0]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert isinstance(spec["headGroupSpec"]["rayStartParams"], dict)
    assert spec["headGroupSpec"]["rayStartParams"].get("num-gpus") == "0"
    groups = spec["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups)
    gpu_key, _ = RAYCLUSTERS[fname]
    for g in groups:
        assert isinstance(g["rayStartParams"], dict)
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        (container,) = _containers(g["template"])
        res = container["resources"]
        assert res["limits"][gpu_key] == res["requests"][gpu_key] > 0
        other = "amd.com/gpu" if gpu_key == "nvidia.com/gpu" else "nvidia.com/gpu"
        assert other not in res["limits"]
        tolerated = {t["key"] for t in g["template"]["spec"].get("tolerations", [])}
        assert gpu_key in tolerated
        # Ray advertises exactly the pod's GPUs (not left to KubeRay's guess from the limits)
        assert int(g["rayStartParams"]["num-gpus"]) == res["limits"][gpu_key]
    (head,) = _containers(spec["headGroupSpec"]["template"])
    assert gpu_key not in head["resources"].get("limits", {})


@pytest.mark.parametrize("fname", sorted(RAYCLUSTERS))
def test_raycluster_elastic_range_spot_groups_and_env(fname):
    rc = load(DEPLOY / "kuberay" / fname)
    c = cluster_conf("kuberay")
    gpu_key, preset = RAYCLUSTERS[fname]
    groups = rc["spec"]["workerGroupSpecs"]

    def gpus(g: dict) -> int:
        return _containers(g["template"])[0]["resources"]["limits"][gpu_key]

    floor = sum(g["minReplicas"] * gpus(g) for g in groups) / c["gpus_per_worker"]
    ceiling = sum(g["maxReplicas"] * gpus(g) for g in groups) / c["gpus_per_worker"]
    assert (floor, ceiling) == (c["min_workers"], c["max_workers"])

    spot = []
    for g in groups:
        pod = g["template"]["spec"]
        selectors = {k: v for k, v in pod.get("nodeSelector", {}).items() if SPOT_SELECTORS.get(k) == v}
        if selectors:
            spot.append(g)
            (key,) = selectors
            # the spot taint is tolerated, or the pod would never schedule onto the spot pool
            assert any(t["key"] == key and t.get("effect") == "NoSchedule" for t in pod["tolerations"])
            assert g["minReplicas"] == 0
    assert spot, "no spot/preemptible worker group"
    assert any(g["minReplicas"] > 0 and g not in spot for g in groups), "no on-demand floor"

    storage = c["storage_path"]
    for g in groups:
        (container,) = _containers(g["template"])
        assert {e["name"]: e["value"] for e in container["env"]} == ENV_PRESETS[preset]
        assert c["cpus_per_worker"] * gpus(g) / c["gpus_per_worker"] <= float(container["resources"]["limits"]["cpu"])
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in g["template"]["spec"]["volumes"]}
        shared = [p for p in mounts if storage.startswith(p + "/")]
        assert shared, f"{storage} is not on a mounted volume"
        assert "persistentVolumeClaim" in volumes[mounts[shared[0]]]
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_rayjob_runs_launch_py_with_the_kuberay_preset():
    (job,) = load_all(DEPLOY / "kuberay" / "rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    cluster_names = {load(DEPLOY / "kuberay" / f)["metadata"]["name"] for f in RAYCLUSTERS}
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] in cluster_names
    argv = job["spec"]["entrypoint"].split()
    assert argv[:2] == ["python", "/app/launch.py"]  # WORKDIR /app in deploy/docker/Dockerfile
    overrides = dict(arg.split("=", 1) for arg in argv[2:])
    assert overrides["cluster"] == "kuberay"
    assert overrides.get("run_name"), "a fixed run_name lets a resubmitted RayJob resume its run"
    # every group option named on the command line exists under conf/
    for group in ("cluster", "model", "precision"):
        if group in overrides:
            assert (REPO / "conf" / group / f"{overrides[group]}.yaml").exists(), (group, overrides[group])
    # the global batch splits over every node-granular world size the cluster may take (8, 16, 24, 32)
    c = cluster_conf("kuberay")
    gbs = int(overrides["train.global_batch_size"])
    assert all(gbs % w == 0 for w in range(c["min_workers"], c["max_workers"] + 1, 8))


def test_dockerfile_builds_both_accelerators_from_one_file():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE" in text and "ARG TORCH_INDEX_URL" in text
    assert "WORKDIR /app" in text and "pip install --no-cache-dir -e ." in text
    ignored = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_docs_cover_every_target():
    doc = (REPO / "docs" / "deploy.md").read_text()
    for fname in [*LAUNCHERS, *RAYCLUSTERS, "rayjob.yaml"]:
        assert fname in doc, fname
    for conf_name in ["aws_h200", "gcp_a3", "azure_mi300x", "kuberay", "existing"]:
        assert f"cluster={conf_name}" in doc, conf_name
    assert doc.isascii()
