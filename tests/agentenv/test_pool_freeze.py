"""`SandboxPool` with ``pause_method: freeze``: a pause is `docker pause` (cgroup freezer), not a CRIU
checkpoint; the member keeps its memory (still counted as running by the budget) and thaws on next use."""

from __future__ import annotations

import uuid

import pytest
from agentenv_testutil import TOKEN_PROCESS

from agentenv import Sandbox, SandboxConfig
from agentenv.backend import docker_client
from agentenv.errors import ConfigError
from agentenv.pool import PoolSettings, SandboxPool

pytestmark = pytest.mark.docker


@pytest.fixture
def frozen_pool(base_image):
    """A freezing pool of one-small-sandbox size with a 1-byte budget (always over it); closed after."""
    config = SandboxConfig.load(memory="128m", pids_limit=64, tmpfs={"/tmp": "size=32m,mode=1777"},
                                exec_timeout_s=60.0, lock_timeout_s=120.0)
    pool = SandboxPool(f"freeze-{uuid.uuid4().hex[:6]}", config=config, pause_method="freeze",
                       warm_starts=False, memory_budget=1, idle_after_s=0.0)
    yield pool
    pool.close()


def docker_paused(sandbox_id: str) -> bool:
    state = docker_client.api().inspect_container(Sandbox.get(sandbox_id).container_id)["State"]
    return bool(state["Paused"])


def test_a_frozen_member_keeps_its_memory_counts_as_running_and_thaws_on_use(frozen_pool):
    pool = frozen_pool
    a = pool.create()
    a.exec(TOKEN_PROCESS)
    token = a.exec("cat /tmp/token").stdout.strip()
    assert pool.pause(a) is True
    assert docker_paused(a.id) and a.status == "running", "frozen by Docker, running for the registry"
    assert pool.pause(a) is False, "already frozen"
    held = pool.running_bytes()
    assert held > 0, "a frozen member still counts as running memory"
    # Over budget (1 byte): freezing frees nothing, so the budget freezes no one and goes over.
    assert pool.ensure_budget(0) == held and pool.metrics().over_budget >= 1
    assert pool.pause_idle() == 0, "an idle frozen member is not frozen again"
    assert a.exec("cat /tmp/token").stdout.strip() == token, "the next use thaws it: same process"
    assert not docker_paused(a.id)
    m = pool.metrics()
    assert (m.pauses, m.resumes, m.disk_bytes) == (1, 1, 0), "no checkpoint on disk"
    assert pool.sandbox_seconds()[1] > 0, "frozen time counts as paused sandbox-seconds"
    assert pool.pause(a) is True  # frozen again: close() must remove a frozen member too
    container = Sandbox.get(a.id).container_id
    pool.close()
    assert Sandbox.get(a.id).status == "closed"
    assert not [c for c in docker_client.api().containers(all=True) if c["Id"] == container]


def test_pause_method_is_checked():
    assert PoolSettings.load().pause_method == "criu"
    with pytest.raises(ConfigError, match="pause_method must be one of criu, freeze"):
        PoolSettings.load(pause_method="stop")
