"""Find what the job can run on: this machine's GPUs (the embedded cluster) or a joined Ray cluster's resources.

orchestration/machine_defaults.py turns the answer into the job's defaults. This driver process never touches the
GPU itself: a CUDA context here would hold memory on GPU 0 that a worker needs, so this machine's GPUs are read by a
short-lived child process (torch sees CUDA and ROCm alike), and only when the machine has GPU device files at all, so
a CPU machine's default job pays nothing for it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys

from orchestration.machine_defaults import NO_GPU, Machine

log = logging.getLogger(__name__)

_PROBE = r"""
import json, torch
out = {"count": 0}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out = {"count": torch.cuda.device_count(), "vendor": "rocm" if torch.version.hip else "cuda",
           "memory_gb": p.total_memory / 1024**3, "name": p.name}
print(json.dumps(out))
"""

# GiB torch reports per device, by the accelerator type Ray labels a node with (accelerator_type:<type>): what a
# joined cluster's worker memory is planned with, since Ray's resources carry no device memory.
ACCELERATOR_MEMORY_GB = {
    "H100": 79.1, "H200": 139.8, "H20": 95.0, "A100": 79.1, "A100-80G": 79.1, "A100-40G": 39.4, "L40S": 44.4,
    "B200": 178.0, "GB200": 184.0, "AMD-Instinct-MI300X-OAM": 191.5, "MI300X": 191.5, "MI325X": 255.9,
    "MI350X": 287.9, "MI355X": 287.9,
}


def visible_gpu_device_files() -> bool:
    """Whether an NVIDIA or AMD GPU driver exposes devices here (and CUDA_VISIBLE_DEVICES does not hide them)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def parse_probe(output: str, source: str) -> Machine:
    info = json.loads(output.strip().splitlines()[-1])
    if not info.get("count"):
        return Machine(source=f"{source}: no GPU visible to torch")
    return Machine(gpu_vendor=info["vendor"], gpu_count=int(info["count"]), gpu_memory_gb=round(info["memory_gb"], 1),
                   gpu_name=info["name"],
                   source=f"{source}: {info['count']} x {info['name']} ({info['memory_gb']:.1f} GiB)")


def detect_this_machine(timeout_s: float = 120.0) -> Machine:
    """This machine's GPUs as torch sees them, read in a child process; NO_GPU when there are none."""
    if not visible_gpu_device_files():
        return NO_GPU
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                              check=True)
        return parse_probe(proc.stdout, "this machine")
    except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
        log.warning("could not read this machine's GPUs (%s): planning for no GPU", exc)
        return Machine(source=f"this machine: GPU devices present but torch could not read them ({exc})")


def machine_from_ray_nodes(nodes: list[dict]) -> Machine:
    """What the alive nodes of a Ray cluster offer (ray.nodes() records): GPUs in all, and the memory of each from
    the accelerator type Ray labels them with."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    gpus = int(sum(n.get("Resources", {}).get("GPU", 0) for n in alive))
    if not gpus:
        return Machine(source=f"the Ray cluster: {len(alive)} node(s), no GPU resources")
    types = sorted({key.split(":", 1)[1] for n in alive for key in n.get("Resources", {})
                    if key.startswith("accelerator_type:")})
    memory = min((ACCELERATOR_MEMORY_GB[t] for t in types if t in ACCELERATOR_MEMORY_GB), default=None)
    vendor = "rocm" if any(t.startswith(("AMD", "MI")) for t in types) else "cuda"
    name = "/".join(types) or "GPU"
    return Machine(gpu_vendor=vendor, gpu_count=gpus, gpu_memory_gb=memory, gpu_name=name,
                   source=f"the Ray cluster's resources: {gpus} x {name} on {len(alive)} node(s)"
                          + (f" ({memory:g} GiB each)" if memory else ""))


def detect_ray_cluster(address: str) -> Machine:
    """The joined cluster's GPUs, read from Ray's node resources (a short connection; run_job connects again)."""
    import ray

    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return machine_from_ray_nodes(ray.nodes())
    finally:
        if ray.is_initialized():
            ray.shutdown()


def needs_detection(cluster_cfg) -> bool:
    """Whether a composed cluster config leaves anything to the machine (else nothing is probed)."""
    return (cluster_cfg.get("device") in (None, "auto")
            or any(cluster_cfg.get(k) is None for k in ("min_workers", "max_workers", "gpus_per_worker",
                                                        "memory_per_worker_gb")))


def detect_machine(cluster_cfg) -> Machine:
    """The machine the job's null settings follow: this one for the embedded cluster, Ray's resources for a joined
    one (cluster.address or RAY_ADDRESS)."""
    if not needs_detection(cluster_cfg):
        return NO_GPU
    address = cluster_cfg.get("address") or os.environ.get("RAY_ADDRESS")
    return detect_ray_cluster(address) if address else detect_this_machine()
