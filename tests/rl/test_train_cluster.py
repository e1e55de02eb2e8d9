"""``trainer=cluster`` on a real multi-node Ray cluster (tests/rl/ray_cluster.py): a head offering
``learner`` and two worker nodes offering ``rollout``, each `ray start`-ed in a network namespace of its
own; the driver is `python -m rl.train` on the head. The learner runs on the head, the rollout workers
one per worker node (``worker_placement: spread``), and each worker's sandboxes are made by its node
(that node's AgentENV registry holds them); success, reward and loss are those of the same run on
local Ray. Killing a worker node's raylet mid-iteration costs that node's share of the iteration only:
Ray restarts its rollout worker on the other worker node, the trainer retries the share there, and the
run finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_cluster import ROOT, RayCluster, ray_cluster
from rl_testutil import TINY

from agentenv.registry import Registry
from rl.trainer import group_seeds

pytestmark = [pytest.mark.docker, pytest.mark.slow]

TWO_WORKERS = (*TINY, "rollout.num_workers=2")  # one group of 2 episodes each


@pytest.fixture(scope="module")
def cluster(task_home, tmp_path_factory) -> Iterator[RayCluster]:  # task_home: Docker and the base image
    with ray_cluster(tmp_path_factory.mktemp("cluster"), workers=2) as made:
        yield made


def made_on(home: Path) -> int:
    """Sandboxes ever made with this AgentENV home (closed ones stay as 'closed' rows)."""
    return len(Registry(home).list_sandboxes(include_closed=True))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(cluster: RayCluster, run_dir: Path, *overrides: str) -> tuple[list[dict], dict]:
    """A run on the cluster that must succeed; its metrics and its final placement.json."""
    done = cluster.train(run_dir, *overrides)
    assert done.returncode == 0, f"rl.train failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return metrics(run_dir), json.loads((run_dir / "placement.json").read_text())


def test_trains_with_the_learner_and_the_workers_on_the_nodes_their_resources_name(cluster, tmp_path):
    before = {node.name: made_on(node.home) for node in cluster.nodes}
    records, placement = train(cluster, tmp_path / "run", *TWO_WORKERS)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["episodes"] == 4 and r["failed_episodes"] == 0 and r["env_steps"] > 0 for r in records)
    assert all(0.0 <= r["success"] <= 1.0 for r in records) and records[-1]["worker_restarts"] == 0
    assert placement["learner"]["ip"] == cluster.head.ip
    assert sorted(w["ip"] for w in placement["workers"]) == sorted(n.ip for n in cluster.workers)
    assert len({w["node_id"] for w in placement["workers"]}) == 2
    # Each worker node's processes made its worker's 2 sandboxes (kept alive into iteration 1); the head
    # made none.
    made = {node.name: made_on(node.home) - before[node.name] for node in cluster.nodes}
    assert made == {"head": 0, "worker1": 2, "worker2": 2}, made
    # The same run on local Ray (same seeds, same split of the groups over 2 workers) learns the same.
    local = subprocess.run([sys.executable, "-m", "rl.train", *TWO_WORKERS, "trainer.num_cpus=3",
                            f"hydra.run.dir={tmp_path / 'local'}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    for key in ("success", "reward", "loss"):
        assert [r[key] for r in metrics(tmp_path / "local")] == [r[key] for r in records], key


def test_a_lost_worker_node_costs_only_its_share(cluster, tmp_path):
    """Worker node 2's raylet is killed at the first reset of iteration 1 (whichever worker gets there
    first): its rollout worker dies with it, Ray restarts it on worker node 1, the trainer retries that
    share there; the other share is not redone, no episode is lost and the run completes."""
    victim, survivor = cluster.workers[1], cluster.workers[0]
    raylet = victim.raylet_pid()
    seeds = group_seeds(0, 1, 2)
    assert not set(seeds) & set(group_seeds(0, 0, 2) + group_seeds(0, 2, 2))
    marker = tmp_path / "killed"
    kill = f"{{cls: 'user_wrappers:KillsProcessOnce', kwargs: {{seeds: {seeds}, pid: {raylet}, " \
           f"marker: '{marker}'}}}}"
    made_before = made_on(survivor.home)
    records, placement = train(cluster, tmp_path / "run", *TWO_WORKERS, "trainer.iterations=3",
                               f"env.wrappers=[{kill}]")
    assert marker.exists() and raylet not in victim.pids()  # the fault really fired
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["episodes"] == 4 and r["failed_episodes"] == 0 for r in records)
    # One restart, the victim's worker's: found dead by the iteration's rollout or by the weight sync
    # after it (a worker outlives its raylet by up to a second and may return its rollout first).
    assert records[0]["worker_restarts"] == 0 and records[-1]["worker_restarts"] == 1
    assert placement["learner"]["ip"] == cluster.head.ip
    assert [w["ip"] for w in placement["workers"]] == [survivor.ip, survivor.ip]
    # The survivor's node made its own worker's 2 sandboxes, then the restarted worker's 2 (kept alive
    # into iteration 2): the victim's share moved there with its worker.
    assert made_on(survivor.home) - made_before == 4
