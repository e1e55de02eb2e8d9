"""Training with ``sandbox.hosts``: the default task's sandboxes live on `agentenv serve` hosts, each in a
network namespace of its own on this machine (tests/server/netns_hosts.py), the rollout workers (local
Ray) reach them over veth addresses with the key the driver hands them. A host that dies mid-run costs
only the episodes whose sandboxes it held: they are counted as failed, the run goes on on the other host.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rl_testutil import TINY, compose

from agentenv.registry import Registry
from rl.driver.trainer import Trainer
from rl.seeds import group_seeds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from netns_hosts import API_KEY, NamespacedHost, namespaced_host  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def made_on(host: NamespacedHost) -> int:
    """Sandboxes the host's server ever made (its registry keeps closed ones as 'closed' rows)."""
    return len(Registry(host.home).list_sandboxes(include_closed=True))


def made_locally(home: Path) -> int:
    return len(Registry(home).list_sandboxes(include_closed=True))


@pytest.fixture(scope="module")
def host_a(tmp_path_factory) -> Iterator[NamespacedHost]:
    with namespaced_host(tmp_path_factory.mktemp("host-a"), index=0) as host:
        yield host


@pytest.fixture
def host_b(tmp_path) -> Iterator[NamespacedHost]:
    with namespaced_host(tmp_path / "host-b", index=1) as host:
        yield host


def test_trains_the_default_task_with_sandboxes_on_a_remote_host(local_ray, task_home, host_a, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("AGENTENV_API_KEY", API_KEY)  # the driver's; Ray's workers started without it
    before, local_before = made_on(host_a), made_locally(task_home)
    cfg = compose(*TINY, f"sandbox.hosts=[{host_a.url}]")
    result = Trainer(cfg, tmp_path / "run").run()
    records = result.history
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["episodes"] == 4 and r["failed_episodes"] == 0 and r["env_steps"] > 0 for r in records)
    assert records[0]["sandboxes_created"] == 4 and records[1]["sandboxes_created"] == 0  # kept alive
    assert records[0]["sandbox_pool_running"] == 0  # no local pool: nothing of it on this machine
    # Every sandbox was made by the remote server, none here; all closed at the end of the run.
    assert made_on(host_a) - before == 4 and made_locally(task_home) == local_before
    assert all(r.state == "closed" for r in Registry(host_a.home).list_sandboxes(include_closed=True))
    assert (result.checkpoint / "policy" / "model.safetensors").is_file()


def test_a_host_that_dies_costs_only_its_episodes(local_ray, host_a, host_b, tmp_path, monkeypatch, caplog):
    """Two equal hosts share the 4 sandboxes 2 + 2 (placement: free memory, then fewest sandboxes); B is
    killed at the first reset of iteration 1: its 2 episodes fail, A's 2 run; iteration 2 places the
    replacements on A and runs all 4."""
    monkeypatch.setenv("AGENTENV_API_KEY", API_KEY)
    seeds = group_seeds(0, 1, 2)
    assert not set(seeds) & set(group_seeds(0, 0, 2) + group_seeds(0, 2, 2))
    marker = tmp_path / "killed"
    kill = f"{{cls: 'user_wrappers:KillsProcessOnce', kwargs: {{seeds: {seeds}, pid: {host_b.proc.pid}, " \
           f"marker: '{marker}'}}}}"
    before_a = made_on(host_a)
    cfg = compose(*TINY, "trainer.iterations=3", f"sandbox.hosts=[{host_a.url},{host_b.url}]",
                  f"env.wrappers=[{kill}]")
    with caplog.at_level(logging.WARNING, logger="k3rl.train"):
        result = Trainer(cfg, tmp_path / "run").run()
    assert marker.exists() and host_b.proc.wait(timeout=10) == -9  # the fault really fired
    records = result.history
    assert [r["iteration"] for r in records] == [0, 1, 2] and all(r["episodes"] == 4 for r in records)
    assert [r["failed_episodes"] for r in records] == [0, 2, 0]
    assert made_on(host_b) == 2 and made_on(host_a) - before_a == 2 + 2  # 2 + 2, then 2 replacements
    failures = [r.getMessage() for r in caplog.records if "episode failed" in r.getMessage()]
    assert len(failures) == 2 and all(host_b.url in f for f in failures), failures
    assert not any(host_a.url in f for f in failures)
