"""A multi-node Ray cluster on this machine, as `ray start` makes one on real machines: every node in a
network namespace of its own, with its own address on a private LAN (10.201.N.0/24, N from the pid so
parallel runs do not collide; a bridge in one more namespace joins them, so the host's firewall and
its loopback see none of it). The head offers the ``learner`` resource, every worker node ``rollout``
(conf/trainer/cluster.yaml); each node has its own ``$AGENTENV_HOME`` (its sandboxes' registry, as
each machine of a cluster has) and reaches this machine's Docker daemon over its Unix socket, which no
network namespace hides.

Each node runs with a private ``--temp-dir``, so `ray start` records its address there and not in
``/tmp/ray/ray_current_cluster``, which a plain ``ray.init()`` elsewhere on this machine would join.
The machines share no run folder: ``RayCluster.runs`` is, on every worker node, a folder of that node's
own (a bind mount in the node's mount namespace, made before `ray start`, so its raylet and every Ray
worker it starts see it there); only the head, where the driver runs, sees the real one. A run whose
``hydra.run.dir`` is under it has its files on the driver's machine only, as on a cluster of machines.
Nodes are stopped by killing the processes of their namespaces (``ip netns pids``), never by
``ray stop``, which stops every Ray node on the machine. Imported by name by tests/rl/test_train_cluster.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from netns_hosts import _ip, remove_labelled  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")
HEAD_PORT = 6379
LEARNER_RANK = "learner_rank"  # each worker node offers one: a 2-rank learner's ranks land on 2 nodes
# The GCS declares a node dead after ~3 missed 1 s health checks (Ray's default takes ~30 s), so a
# killed raylet's actors are restarted elsewhere within the test's budget.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                   "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}


@dataclass
class RayNode:
    """One `ray start` node: its namespace, address, resources, ``--temp-dir`` and ``$AGENTENV_HOME``."""

    name: str
    namespace: str
    ip: str
    resources: dict[str, float]
    num_cpus: int
    temp_dir: Path
    home: Path

    def pids(self) -> list[int]:
        """Every process in the node's namespace (its raylet, agents, Ray workers, a driver run there)."""
        out = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True,
                             timeout=30).stdout
        return [int(p) for p in out.split()]

    def raylet_pid(self) -> int:
        for pid in self.pids():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    return pid
            except OSError:
                continue
        raise RuntimeError(f"no raylet runs in {self.namespace}")


@dataclass
class RayCluster:
    head: RayNode
    workers: list[RayNode]
    lan: str
    token_path: Path  # the cluster's Ray token, handed to every node and driver (RAY_AUTH_TOKEN_PATH)
    nodes: list[RayNode] = field(default_factory=list)
    runs: Path | None = None  # the run folders: the head's own; each worker node sees one of its own there

    def view_of_runs(self, node: RayNode) -> Path:
        """What ``node`` sees at `runs` (a folder of this machine: the head's is `runs` itself)."""
        return self.runs if node is self.head else self.runs.parent / "node-views" / node.name

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{HEAD_PORT}"

    def environment(self, node: RayNode) -> dict[str, str]:
        """The environment of a process on ``node``: its AgentENV home, the test helpers importable."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        # token authentication (Ray's default for a new cluster) on every node and driver alike, with
        # the cluster's own token file: nothing is read from (or written to) the home folder
        env.update(AGENTENV_HOME=str(node.home), RAY_worker_niceness="0", RAY_USAGE_STATS_ENABLED="0",
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]))
        return env

    def run(self, node: RayNode, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """``argv`` inside ``node``'s namespace (the way a command runs on that machine)."""
        return subprocess.run(["ip", "netns", "exec", node.namespace, *argv], cwd=ROOT,
                              env=self.environment(node), capture_output=True, text=True, timeout=timeout_s)

    def train(self, run_dir: Path, *overrides: str, timeout_s: float = 420) -> subprocess.CompletedProcess:
        """``python -m rl.train trainer=cluster trainer.ray_address=HEAD:PORT ...`` on the head node."""
        argv = [sys.executable, "-m", "rl.train", "trainer=cluster", f"trainer.ray_address={self.address}",
                *overrides, f"hydra.run.dir={run_dir}"]
        return self.run(self.head, argv, timeout_s)


@contextlib.contextmanager
def _lan(pid: int, count: int) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """Namespaces ``k3rc-<pid>-<i>`` for ``count`` nodes, each with one veth end (10.201.N.i+1/24) whose
    peer sits on a bridge in namespace ``k3rc-<pid>-lan``; yields (lan, [(namespace, address), ...])."""
    n = pid % 250
    lan = f"k3rc-{pid}-lan"
    made: list[str] = []
    try:
        _ip("netns", "add", lan)
        made.append(lan)
        for args in (("link", "add", "br0", "type", "bridge"), ("link", "set", "br0", "up"),
                     ("link", "set", "lo", "up")):
            _ip("netns", "exec", lan, "ip", *args)
        nodes = []
        for i in range(count):
            ns, ip = f"k3rc-{pid}-{i}", f"10.201.{n}.{i + 1}"
            lan_if, node_if = f"k3rc{pid}l{i}", f"k3rc{pid}n{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", lan_if, "type", "veth", "peer", "name", node_if)
            _ip("link", "set", lan_if, "netns", lan)
            _ip("link", "set", node_if, "netns", ns)
            for args in (("link", "set", lan_if, "master", "br0"), ("link", "set", lan_if, "up")):
                _ip("netns", "exec", lan, "ip", *args)
            for args in (("addr", "add", f"{ip}/24", "dev", node_if), ("link", "set", node_if, "up"),
                         ("link", "set", "lo", "up")):
                _ip("netns", "exec", ns, "ip", *args)
            nodes.append((ns, ip))
        yield lan, nodes
    finally:
        for ns in reversed(made):  # deleting a namespace deletes its veth ends and the bridge
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def make_token(path: Path) -> Path:
    """A new Ray token in ``path`` (owner-only), as `ray get-auth-token --generate` writes one to the
    home folder: 256 random bits in hex."""
    path.touch(mode=0o600)
    path.write_text(secrets.token_hex(32))
    return path


def stop_node(node: RayNode, grace_s: float = 2.0, term: bool = True) -> None:
    """SIGTERM then SIGKILL to every process of the node's namespace (all started by this fixture);
    ``term=False``: SIGKILL at once (the end of a cluster whose state nothing reads any more)."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if term else (signal.SIGKILL,):
        pids = node.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while node.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not node.pids():
            return


def _start(cluster: RayCluster, node: RayNode, head: bool) -> None:
    argv = [RAY, "start", "--node-ip-address", node.ip, "--num-cpus", str(node.num_cpus),
            "--resources", json.dumps(node.resources), "--temp-dir", str(node.temp_dir),
            "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
    if head:
        argv += ["--head", "--port", str(HEAD_PORT), "--include-dashboard=false"]
    else:
        argv += ["--address", cluster.address]
    env = {**cluster.environment(node), **FAST_NODE_DEATH}
    if cluster.runs is not None and node is not cluster.head:  # this node's own folder at cluster.runs
        view = cluster.view_of_runs(node)
        view.mkdir(parents=True, exist_ok=True)
        mount = f'mount --bind "{view}" "{cluster.runs}" && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *argv]
    done = subprocess.run(["ip", "netns", "exec", node.namespace, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"`ray start` on {node.name} ({node.ip}) failed:\n{done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")


def _wait_for_nodes(cluster: RayCluster, timeout_s: float = 120.0) -> None:
    """Until the head's GCS counts exactly the cluster's nodes alive (asked from the head's namespace; a node
    killed earlier must have been declared dead). The GCS is asked directly, as `ray start` asks it whether
    its node registered: a `ray.init` driver would cost a second more, every time."""
    script = ("import sys; from ray._raylet import GcsClient; "
              "from ray.core.generated.gcs_pb2 import GcsNodeInfo; "
              "nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=30).values(); "
              "print(sum(n.state == GcsNodeInfo.GcsNodeState.ALIVE for n in nodes))")
    deadline = time.monotonic() + timeout_s
    while True:
        done = cluster.run(cluster.head, [sys.executable, "-c", script, cluster.address], timeout_s=120)
        alive = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        if alive == str(len(cluster.nodes)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster has {alive or 'no'} of {len(cluster.nodes)} nodes alive: "
                               f"{done.stderr[-2000:]}")
        time.sleep(1)


@contextlib.contextmanager
def ray_cluster(base: Path, workers: int = 2, worker_rollout: float = 2,
                worker_cpus: int = 2) -> Iterator[RayCluster]:
    """A head (1 CPU, ``{"learner": 1}``) and ``workers`` worker nodes (``worker_cpus`` CPUs and
    ``{"rollout": worker_rollout, LEARNER_RANK: 1}`` each), each in its namespace, their AgentENV homes
    under ``base``; everything stopped, its sandboxes removed and the namespaces deleted at the end, even
    on failure."""
    pid = os.getpid()
    tmp = Path(f"/tmp/k3rc-{pid}")  # short: Ray's socket paths live under each node's --temp-dir
    with _lan(pid, 1 + workers) as (lan, addresses):
        nodes = []
        for i, (ns, ip) in enumerate(addresses):
            name = "head" if i == 0 else f"worker{i}"
            # worker nodes also take one rank each of a sharded learner (test_train_cluster.py)
            resources = {"learner": 1.0} if i == 0 else {"rollout": float(worker_rollout), LEARNER_RANK: 1.0}
            home = base / name
            home.mkdir(parents=True, exist_ok=True)
            nodes.append(RayNode(name, ns, ip, resources, 1 if i == 0 else worker_cpus, tmp / name, home))
        runs = base / "runs"
        runs.mkdir(exist_ok=True)
        cluster = RayCluster(nodes[0], nodes[1:], lan, make_token(base / "ray_auth_token"), nodes, runs)
        try:
            with ThreadPoolExecutor(2 * len(nodes)) as pool:  # the machines set up at once, as real ones do
                # each machine builds the sandbox image for its own AgentENV home while Ray starts (no
                # sandbox is made before the first run)
                build = [sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"]
                builds = [pool.submit(subprocess.run, build, env=cluster.environment(node), cwd=ROOT,
                                      check=True, capture_output=True, timeout=600) for node in nodes]
                _start(cluster, cluster.head, head=True)
                list(pool.map(lambda node: _start(cluster, node, head=False), cluster.workers))
                for built in builds:
                    built.result()
            _wait_for_nodes(cluster)
            yield cluster
        finally:
            with ThreadPoolExecutor(len(nodes)) as pool:
                # workers first: the head's GCS outlives them
                list(pool.map(lambda node: stop_node(node, term=False), cluster.workers))
                stop_node(cluster.head, term=False)
                list(pool.map(lambda node: remove_labelled(node.home), nodes))
            shutil.rmtree(tmp, ignore_errors=True)
