"""An autoscaled Ray cluster on one machine: Ray's fake multi-node provider launches and terminates "nodes" (a raylet
and its workers each, local processes) on demand, as a cloud provider would launch VMs. The node types are those of
deploy/ray/*.yaml and deploy/kuberay/*.yaml on CPU: a head that never holds a training worker, one on-demand node
that is always there (the floor of the elastic range), and spot nodes the autoscaler adds while the run asks for
more workers and that may leave, with notice (a drain with a deadline) or without. tests/test_elastic_e2e.py and
docs/reliability.md use it; a person can watch it too (docs/deploy.md, "Autoscaling on one machine"):

    python -m orchestration.driver.autoscale_local up --port 6390       # prints the address and the dashboard URL
    python launch.py cluster=autoscale_local                             # joins 127.0.0.1:6390
    python -m orchestration.driver.autoscale_local drain --port 6390 --deadline-s 20   # a spot node gets notice
    python -m orchestration.driver.autoscale_local down --port 6390

Ray's own ray.cluster_utils.AutoscalingCluster does the same but runs `ray stop --force`, which would stop every
Ray cluster on the machine; this one starts its head as its own process group and ends only that group.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestration.observability.dashboard import ray_executable

# The fake provider knows its head by this name (the cloud configs call theirs "head").
HEAD_TYPE = "ray.head.default"
ONDEMAND_TYPE = "cpu_ondemand"
SPOT_TYPE = "cpu_spot"
# Each node carries its node type as this label (the fake provider does not set Ray's own ray.io/node-group, and
# custom labels may not use the ray.io/ prefix): the dashboard's Cluster page shows it.
NODE_TYPE_LABEL = "node-type"
# Spot nodes that stand idle go back after this; the cloud configs use minutes, a test cannot wait that long.
IDLE_TIMEOUT_MINUTES = 0.5
DEFAULT_PORT = 6390
# The fake provider's id for the head; autoscaler v2 needs the head's Ray node id to equal its instance id.
FAKE_HEAD_NODE_ID = "f" * 51 + "00000"


def node_types(spot_nodes: int, cpus_per_node: int = 1) -> dict[str, dict[str, Any]]:
    """The autoscaler's available_node_types, head included (pure). Each worker node holds `cpus_per_node` training
    workers (cluster.cpus_per_worker=1): what a GPU node's GPUs are in the cloud configs."""
    return {
        # The driver, Ray Train's controller and the autoscaler only: no CPU, so no training worker lands here.
        HEAD_TYPE: {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
        ONDEMAND_TYPE: {"resources": {"CPU": cpus_per_node}, "labels": {NODE_TYPE_LABEL: ONDEMAND_TYPE},
                        "node_config": {}, "min_workers": 1, "max_workers": 1},
        SPOT_TYPE: {"resources": {"CPU": cpus_per_node}, "labels": {NODE_TYPE_LABEL: SPOT_TYPE}, "node_config": {},
                    "min_workers": 0, "max_workers": spot_nodes},
    }


def autoscaler_config(gcs_port: int, spot_nodes: int, cpus_per_node: int = 1) -> dict[str, Any]:
    """The cluster config `ray start --autoscaling-config` reads, for the fake multi-node provider (pure)."""
    return {
        "cluster_name": f"autoscale-local-{gcs_port}",
        "max_workers": 1 + spot_nodes,
        # The fake provider through the "external" type: Ray's wheel lacks the fake_multinode type's defaults file
        # that autoscaler v2 reads.
        "provider": {"type": "external",
                     "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
                     "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID,
                     # The provider's own default is port 6379, another cluster's on a shared machine.
                     "gcs_address": f"127.0.0.1:{gcs_port}"},
        "available_node_types": node_types(spot_nodes, cpus_per_node),
        "head_node_type": HEAD_TYPE,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
        "auth": {}, "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


@dataclass(frozen=True)
class Node:
    node_id: str
    node_type: str
    alive: bool
    start_time_s: float | None  # when the node registered (epoch seconds)

    @classmethod
    def from_state_api(cls, record: dict[str, Any]) -> Node:
        start_ms = record.get("start_time_ms")
        return cls(node_id=record["node_id"], node_type=(record.get("labels") or {}).get(NODE_TYPE_LABEL, HEAD_TYPE),
                   alive=record.get("state") == "ALIVE",
                   start_time_s=start_ms / 1000 if start_ms else None)


def free_port(taken: int | None = None) -> int:
    """A port free on loopback now, for `ray start` to bind a moment later: below the kernel's ephemeral range. A port
    that bind(0) hands out lies in that range, where any process's outgoing connection may take it first; in a CI
    run the dashboard's port, picked so, was in use on both tries of one start, a minute apart, and free after."""
    low = ephemeral_ports()[0]
    for _ in range(1000):
        port = random.randint(PORT_FLOOR, max(PORT_FLOOR, low - 1))
        if port == taken:  # already picked for another of the head's services, not yet bound
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 between {PORT_FLOOR} and {low - 1}")


# Ports below this are Ray's own by default (workers 10002-19999, its client server 10001; `ray start` refused a GCS
# port of 10909: "worker_ports is trying to use a port number 10909") or a machine's services (Prometheus 9090 ...).
PORT_FLOOR = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


class LocalAutoscalingCluster:
    """The head (GCS, dashboard, autoscaler) as one `ray start --block` process group; the autoscaler's fake nodes
    are started by its monitor process, inside that group, so stop() ends them all and nothing else."""

    def __init__(self, workdir: Path, spot_nodes: int = 1, port: int | None = None, env: dict[str, str] | None = None,
                 dashboard_port: int | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.given_ports = (port, dashboard_port)
        self._pick_ports()
        self.spot_nodes = spot_nodes
        self.env = dict(os.environ if env is None else env)
        # The fake nodes join without Ray's token (they are started with the monitor's environment).
        self.env.setdefault("RAY_AUTH_MODE", "disabled")
        # Autoscaler v2 (what KubeRay runs): it reconciles the provider's instances with the nodes the GCS sees, so a
        # node that died is replaced; v1 keeps a dead fake node listed and launches nothing.
        self.env.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_USAGE_STATS_ENABLED": "0",
                         "RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                         "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID})
        self.head: subprocess.Popen | None = None

    def _pick_ports(self) -> None:
        """The ports given, else free ones: picked again for each try of a start, in case one was taken meanwhile."""
        port, dashboard_port = self.given_ports
        self.port = port or free_port()
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port or free_port(taken=self.port)}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.workdir / f"autoscaler-{self.port}.json"

    def set_spot_nodes(self, spot_nodes: int) -> None:
        """The most spot nodes the cloud can give now: the autoscaler (v2) reads its config again at every update, so
        raising this is spot capacity becoming available, and lowering it to 0 before a node leaves keeps the
        autoscaler from replacing it."""
        self.spot_nodes = spot_nodes
        tmp = self.config_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(autoscaler_config(self.port, spot_nodes), indent=2))
        tmp.replace(self.config_file)  # the autoscaler never reads half a file

    def start(self, timeout_s: float = 240, attempts: int = 2) -> LocalAutoscalingCluster:
        """The head, then the on-demand node the autoscaler launches for min_workers. On a loaded machine Ray's head
        can give up during its own start (a component waits a fixed time for another); the whole start is then
        tried once more."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout_s)
            except (RuntimeError, TimeoutError):
                self.stop()
                if attempt == attempts:
                    raise
                self._pick_ports()
        return self

    def _start_once(self, timeout_s: float) -> LocalAutoscalingCluster:
        config = self.config_file
        self.set_spot_nodes(self.spot_nodes)  # writes the config file
        dashboard_port = self.dashboard_url.rsplit(":", 1)[1]
        # The head is the config's HEAD_TYPE, which runs no worker: zero CPUs, and zero GPUs too, since `ray start`
        # would otherwise offer this machine's GPUs on it and the job would plan GPU workers the nodes do not have.
        self.head = subprocess.Popen(
            [ray_executable(), "start", "--head", f"--port={self.port}", "--num-cpus=0", "--num-gpus=0",
             f"--autoscaling-config={config}",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
             "--disable-usage-stats", "--block"],
            env=self.env, stdout=open(self.workdir / f"head-{self.port}.log", "a"),  # noqa: SIM115  # until stop()
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        while not self.alive(ONDEMAND_TYPE):
            if self.head.poll() is not None:
                raise RuntimeError(f"the head node exited ({self.head.returncode}); see {self.workdir}/head-*.log")
            if time.time() > deadline:
                raise TimeoutError(f"the on-demand node was not up within {timeout_s:.0f} s")
            time.sleep(1)
        return self

    def nodes(self) -> list[Node]:
        """Every node the GCS knows (dead ones too), from the dashboard's state API; [] while it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.dashboard_url}/api/v0/nodes?limit=1000&detail=true",
                                        timeout=5) as resp:
                records = json.loads(resp.read())["data"]["result"]["result"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [Node.from_state_api(r) for r in records]

    def alive(self, node_type: str | None = None) -> list[Node]:
        return sorted((n for n in self.nodes() if n.alive and (node_type is None or n.node_type == node_type)),
                      key=lambda n: n.start_time_s or 0)

    def drain(self, node_id: str, deadline_s: int, reason: str = "DRAIN_NODE_REASON_PREEMPTION") -> None:
        """What a cloud's preemption notice becomes in Ray (and what the autoscaler itself does before it terminates
        a node): the GCS marks the node draining, with the time it will be gone. Nothing is killed here."""
        proc = subprocess.run([ray_executable(), "drain-node", f"--address={self.address}", f"--node-id={node_id}",
                               f"--reason={reason}", "--reason-message=autoscale_local: notice before the node goes",
                               f"--deadline-remaining-seconds={int(deadline_s)}"],
                              env=self.env, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"ray drain-node {node_id} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    def kill_node(self, node_id: str) -> int:
        """SIGKILL every process of one fake node (its raylet, agents and workers): the machine is gone, no goodbye.
        The autoscaler then sees the node dead and may launch a replacement. Returns the number of processes."""
        import ray  # noqa: F401, I001  # first: puts Ray's own copy of psutil on the path
        import psutil

        victims = []
        for proc in psutil.process_iter(["pid", "name"]):
            try:
                # The node's raylet carries its fake instance id; its agents and workers are the raylet's children.
                if proc.info["name"] == "raylet" and proc.environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id:
                    victims += [proc, *proc.children(recursive=True)]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        for proc in victims:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=30)
        return len(victims)

    def stop(self) -> None:
        if self.head is None:
            return
        try:
            os.killpg(self.head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.head.wait(timeout=30)
        self.head = None


def wait_until(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestration.driver.autoscale_local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "drain", "kill", "down"])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the head's GCS port")
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--spot-nodes", type=int, default=1, help="up: most spot nodes the autoscaler may add")
    parser.add_argument("--node-id", help="drain/kill: the node (default: the newest alive spot node)")
    parser.add_argument("--deadline-s", type=int, default=20, help="drain: seconds until the node is killed")
    parser.add_argument("--workdir", default="/tmp/autoscale_local")
    args = parser.parse_args(argv)
    cluster = LocalAutoscalingCluster(Path(args.workdir), spot_nodes=args.spot_nodes, port=args.port,
                                      dashboard_port=args.dashboard_port)
    pid_file = Path(args.workdir) / f"head-{args.port}.pid"
    if args.command == "up":
        cluster.start()
        assert cluster.head is not None
        pid_file.write_text(str(cluster.head.pid))
        print(f"address: {cluster.address}  (python launch.py cluster=autoscale_local cluster.address="
              f"{cluster.address})\ndashboard: {cluster.dashboard_url}/#/cluster", flush=True)
        return 0
    if args.command == "down":
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
            pid_file.unlink()
        return 0
    node_id = args.node_id
    if node_id is None:
        spot = cluster.alive(SPOT_TYPE)
        if not spot:
            print("no alive spot node", file=sys.stderr)
            return 1
        node_id = spot[-1].node_id
    if args.command == "kill":
        print(f"killed {cluster.kill_node(node_id)} processes of node {node_id}")
        return 0
    cluster.drain(node_id, args.deadline_s)
    print(f"node {node_id} drained; killing it in {args.deadline_s} s (the cloud's part)", flush=True)
    time.sleep(args.deadline_s)
    print(f"killed {cluster.kill_node(node_id)} processes of node {node_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
