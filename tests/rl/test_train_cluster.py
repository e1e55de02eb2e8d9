"""``trainer=cluster`` on a real multi-node Ray cluster (tests/rl/ray_cluster.py): a head offering
``learner`` and two worker nodes offering ``rollout``, each `ray start`-ed in a network namespace of its
own; the driver is `python -m rl.train` on the head. The learner runs on the head, the rollout workers
one per worker node (``worker_placement: spread``), and each worker's sandboxes are made by its node
(that node's AgentENV registry holds them); success, reward and loss are those of the same run on
local Ray. Killing a worker node's raylet mid-iteration costs that node's share of the iteration only:
Ray restarts its rollout worker on the other worker node, the trainer retries the share there, and the
run finishes. The same holds for ``trainer.mode=async`` (rl/driver/async_source.py): an async run places its
actors the same way and logs staleness and learner idleness (it is not replayable, so no local run is
compared with it); a worker node lost mid-iteration costs only the rollout calls queued on its worker,
which are resubmitted to the worker restarted on the other node. A learner of two ranks
(``trainer.learner.world_size=2``) trains with one rank on each of two nodes that do not share the run
folder with the driver: its checkpoints are whole in the driver's folder and resume there; killing one
rank's node stops the run with `LearnerRankLost` naming it, and its last complete checkpoint stays
loadable.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ray_cluster import LEARNER_RANK, RayCluster, RayNode, _start, _wait_for_nodes, ray_cluster, stop_node
from rl_testutil import TINY, assert_drops_add_up, compose

from agentenv.owner import OWNER_LABEL
from agentenv.registry import Registry
from rl.driver.trainer import Trainer
from rl.seeds import ASYNC_SEEDS, group_seeds

pytestmark = [pytest.mark.docker, pytest.mark.slow]

TWO_WORKERS = (*TINY, "rollout.num_workers=2")  # one group of 2 episodes each
# 2 workers x 2 calls in flight, each call one group (ceil(2 groups / 4)); staleness bound 2 versions
ASYNC = (*TWO_WORKERS, "trainer.mode=async", "trainer.rollouts_in_flight=2", "trainer.max_staleness=2",
         "trainer.checkpoint_every=0")


@pytest.fixture(scope="module")
def started_cluster(task_home, tmp_path_factory) -> Iterator[RayCluster]:  # task_home: Docker, base image
    with ray_cluster(tmp_path_factory.mktemp("cluster"), workers=2) as made:
        yield made


@pytest.fixture
def cluster(started_cluster: RayCluster) -> RayCluster:
    """The module's cluster with every worker node up: a node whose raylet an earlier test killed is
    started again (what is left of it stopped first), as an operator puts a repaired machine back."""
    down = [node for node in started_cluster.workers if not raylet_runs(node)]
    for node in down:
        stop_node(node)
        _start(started_cluster, node, head=False)
    if down:
        _wait_for_nodes(started_cluster)
    return started_cluster


def raylet_runs(node: RayNode) -> bool:
    try:
        node.raylet_pid()
    except RuntimeError:
        return False
    return True


def made_on(home: Path) -> int:
    """Sandboxes ever made with this AgentENV home (closed ones stay as 'closed' rows)."""
    return len(Registry(home).list_sandboxes(include_closed=True))


def owners(home: Path) -> set[str]:
    """The processes (`agentenv.owner` labels) that made the sandboxes ever made with this home. A sandbox
    that an in-flight checkpoint kept has traded its owner label for a keeper label (`SandboxPool.keep`):
    whether one was in flight at a checkpoint depends on timing, so it is not counted."""
    records = Registry(home).list_sandboxes(include_closed=True)
    return {r.labels[OWNER_LABEL] for r in records if OWNER_LABEL in r.labels}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def async_call_seeds(*calls: int) -> list[int]:
    """The task seed of each async rollout call numbered in ``calls``, for a run with ``seed=0`` started
    at iteration 0 and one group per call (as `rl.driver.async_source.AsyncRollouts._submit` draws them)."""
    return [int(np.random.SeedSequence([0, ASYNC_SEEDS, 0, c]).generate_state(1)[0]) % 2**31 for c in calls]


def train(cluster: RayCluster, run_dir: Path, *overrides: str) -> tuple[list[dict], dict]:
    """A run on the cluster that must succeed; its metrics and its final placement.json."""
    done = cluster.train(run_dir, *overrides)
    assert done.returncode == 0, f"rl.train failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return metrics(run_dir), json.loads((run_dir / "placement.json").read_text())


def test_trains_on_the_nodes_its_resources_name_and_a_lost_worker_node_costs_only_its_share(
        cluster, local_ray, tmp_path):
    """The learner runs on the head, one rollout worker on each worker node, and each worker's sandboxes
    are made by its node. Worker node 2's raylet is killed at the first reset of iteration 1 (whichever
    worker gets there first): its rollout worker dies with it, Ray restarts it on worker node 1, the
    trainer retries that share there; the other share is not redone, no episode is lost, and the run
    learns exactly what the same run on local Ray learns."""
    victim, survivor = cluster.workers[1], cluster.workers[0]
    raylet = victim.raylet_pid()
    seeds = group_seeds(0, 1, 2)
    assert not set(seeds) & set(group_seeds(0, 0, 2) + group_seeds(0, 2, 2))
    marker = tmp_path / "killed"
    kill = f"{{cls: 'user_wrappers:KillsProcessOnce', kwargs: {{seeds: {seeds}, pid: {raylet}, " \
           f"marker: '{marker}'}}}}"
    before = {node.name: made_on(node.home) for node in cluster.nodes}
    # The same run on local Ray (below) plays meanwhile, in this process: the two share nothing (their
    # own Ray, AgentENV homes and run folders), and a sync run's results do not depend on its timing.
    with ThreadPoolExecutor(1) as pool:
        on_cluster = pool.submit(train, cluster, tmp_path / "run", *TWO_WORKERS, "trainer.iterations=3",
                                 f"env.wrappers=[{kill}]")
        local = compose(*TWO_WORKERS, "trainer.iterations=3", "trainer.num_cpus=3")
        history = Trainer(local, tmp_path / "local").run().history
        records, placement = on_cluster.result()
    assert marker.exists() and raylet not in victim.pids()  # the fault really fired
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["episodes"] == 4 and r["failed_episodes"] == 0 and r["env_steps"] > 0 for r in records)
    assert all(r["success"] * 4 == pytest.approx(round(r["success"] * 4)) for r in records)  # of 4 episodes
    # One restart, the victim's worker's: found dead by the iteration's rollout or by the weight sync
    # after it (a worker outlives its raylet by up to a second and may return its rollout first).
    assert records[0]["worker_restarts"] == 0 and records[-1]["worker_restarts"] == 1
    assert placement["learner"]["ip"] == cluster.head.ip
    assert [w["ip"] for w in placement["workers"]] == [survivor.ip, survivor.ip]
    # Each worker node's processes made its own worker's 2 sandboxes (kept alive into iteration 1), so one
    # worker started on each; the survivor's then made the restarted worker's 2 (kept alive into
    # iteration 2): the victim's share moved there with its worker. The head made none.
    made = {node.name: made_on(node.home) - before[node.name] for node in cluster.nodes}
    assert made == {"head": 0, victim.name: 2, survivor.name: 4}, made
    # The same run on local Ray (same seeds, same split of the groups over 2 workers, nothing killed)
    # learns the same: the retried share replayed exactly what the lost worker would have played.
    for key in ("success", "reward", "loss"):
        assert [r[key] for r in history] == [r[key] for r in records], key


def test_a_lost_worker_node_costs_an_async_run_only_its_calls(cluster, tmp_path):
    """An async run places its actors as a sync one does and logs staleness and learner idleness. Worker
    node 2's raylet is killed at the first reset of async call 4 or 5 (the first calls queued after one
    finished, on whichever worker finished first): the calls queued on its worker fail, the driver
    reloads the worker Ray restarts on worker node 1 and resubmits them there, and the run completes
    every iteration without a failed episode; the survivor's own worker is not restarted."""
    victim, survivor = cluster.workers[1], cluster.workers[0]
    raylet = victim.raylet_pid()
    marker = tmp_path / "killed"
    # After the kill every reset waits for the trainer to reload the lost worker on the survivor, so the
    # survivor's own worker cannot finish the run (4 iterations: 8 groups, only calls 0-3 reset before the
    # kill) before Ray declares the victim node dead.
    kill = f"{{cls: 'user_wrappers:KillsProcessThenWaits', kwargs: {{seeds: {async_call_seeds(4, 5)}, " \
           f"pid: {raylet}, marker: '{marker}', placement: '{tmp_path / 'run' / 'placement.json'}', " \
           f"ip: '{survivor.ip}'}}}}"
    before = {node.name: owners(node.home) for node in cluster.workers}
    head_made = made_on(cluster.head.home)
    records, placement = train(cluster, tmp_path / "run", *ASYNC, "trainer.iterations=4",
                               f"env.wrappers=[{kill}]")
    assert marker.exists() and raylet not in victim.pids()  # the fault really fired
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert [r["weights_version"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    assert all(r["episodes"] >= 4 and r["failed_episodes"] == 0 for r in records)
    for r in records:
        assert r["env_steps"] > 0 and 0.0 <= r["success"] <= 1.0 and 0.0 <= r["learner_idle_fraction"] <= 1.0
        assert 0.0 <= r["staleness_mean"] <= r["staleness_max"] <= 2
    assert_drops_add_up(records, group_size=2, episodes_per_step=4)
    assert records[-1]["worker_restarts"] >= 1
    assert placement["learner"]["ip"] == cluster.head.ip
    assert [w["ip"] for w in placement["workers"]] == [survivor.ip, survivor.ip]
    # The survivor's node made sandboxes for two worker processes (its own worker and the restarted one),
    # the victim's for one (its worker, before it died): one worker started on each node; the head made
    # none.
    assert made_on(cluster.head.home) == head_made
    made_by = {node.name: owners(node.home) - before[node.name] for node in cluster.workers}
    assert len(made_by[survivor.name]) == 2 and len(made_by[victim.name]) == 1, made_by


def test_two_learner_ranks_on_nodes_that_share_no_folder_checkpoint_whole_and_a_lost_rank_stops_the_run(
        cluster, tmp_path):
    """The ranks of a world_size-2 learner go one per worker node (each offers one LEARNER_RANK) and
    train together (gloo over the cluster's LAN), and the run folder is the head's alone
    (`RayCluster.runs`: every worker node sees a folder of its own there). Every checkpoint is whole in
    the head's folder (each rank's files came through Ray, checked against their sizes and SHA-256s) and
    nothing is written to the nodes' own folders; the run resumes there at world size 2 (the ranks read
    the files through Ray too). Once the resumed run has a checkpoint of its own, the node of the rank
    beside no rollout worker is killed: the run stops at its next learner step with an error naming
    that rank and node, is not retried, and the newest complete checkpoint loads at world size 1."""
    from rl.checkpoints import read_checkpoint
    from rl.learner.learner import Learner
    from rl.learner.manifest import check_files, read_manifest

    run_dir = cluster.runs / tmp_path.name
    overrides = (*TINY, "algo.minibatches=1", "trainer.checkpoint_every=1", "trainer.learner.world_size=2",
                 f"+trainer.learner_resources.{LEARNER_RANK}=1", "~trainer.learner_resources.learner")
    first, _placement = train(cluster, run_dir, *overrides, "trainer.iterations=1")
    assert [r["iteration"] for r in first] == [0]
    for iteration in (0,):
        folder = run_dir / "checkpoints" / f"iter_{iteration:05d}"
        saved = read_manifest(folder)
        assert saved["world_size"] == 2
        assert sorted(saved["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        check_files(folder, saved, checksums=True)
    for node in cluster.workers:  # what each worker node sees at the run folder: nothing was written there
        assert not any(cluster.view_of_runs(node).rglob("*")), node.name

    train_argv = [sys.executable, "-m", "rl.train", "trainer=cluster",
                  f"trainer.ray_address={cluster.address}"]  # fmt: skip
    resumed = (*overrides, "trainer.iterations=40", f"trainer.resume={run_dir}")
    run_dir = cluster.runs / f"{tmp_path.name}-resumed"
    argv = ["ip", "netns", "exec", cluster.head.namespace, *train_argv, *resumed, f"hydra.run.dir={run_dir}"]
    run = subprocess.Popen(argv, cwd=Path(__file__).parents[2], env=cluster.environment(cluster.head),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        own = run_dir / "checkpoints" / "iter_00001" / "trainer_state.json"  # the resumed run's first
        while not own.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not own.exists():
            ended = run.poll()
            pytest.fail(f"no checkpoint (rl.train: {ended}) {run.stderr.read()[-3000:] if ended else ''}")
        log = (run_dir / "train.log").read_text()
        joined = next(line for line in log.splitlines() if "ranks joined at" in line)
        nodes = ast.literal_eval(joined.split(" on nodes ")[1])
        assert sorted(nodes) == sorted(node.ip for node in cluster.workers)  # one rank per worker node
        rollout = {w["ip"] for w in json.loads((run_dir / "placement.json").read_text())["workers"]}
        rank = next(r for r, ip in enumerate(nodes) if ip not in rollout)
        by_ip = {node.ip: node for node in cluster.nodes}
        stop_node(by_ip[nodes[rank]])
        _out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, err[-3000:]
    assert f"learner rank {rank} of 2 (node {nodes[rank]}) failed" in err, err[-3000:]
    assert "k3rl-train: training stopped: " in err
    folder, state = read_checkpoint(run_dir, stage="rl")  # the newest complete checkpoint
    assert state.iteration >= 1
    check_files(folder, read_manifest(folder), checksums=True)
    Learner(compose(*overrides[:-3], "trainer.num_cpus=3")).load(folder)  # written by 2 ranks, read by 1
