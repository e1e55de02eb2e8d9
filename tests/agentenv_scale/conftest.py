"""Fixtures for the fast-path tests: a real dockerd + CRIU, a base image, and a throwaway image store."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from agentenv.fastpath import FastPath, FastPathSettings, FastPathUnavailable
from agentenv.fastpath.clone import remove_container
from agentenv.paths import PROJECT_ROOT

TEST_LABEL = "org.k3rl.test"
TEST_LABEL_VALUE = "agentenv_scale"

# A process whose state can only survive a real restore: a random token and a counter live in its
# memory; a buffer's digest is recomputed from memory every 10 steps. It publishes them in /tmp (a
# tmpfs, which CRIU saves with the memory) for `docker exec cat` to read.
STATE_PROGRAM = r"""
import hashlib, os, time
token = os.urandom(8).hex()
buf = bytearray(os.urandom(4096)) * (8 * 256)
count = 0
digest = hashlib.sha256(buf).hexdigest()[:16]
while True:
    count += 1
    if count % 10 == 0:
        digest = hashlib.sha256(buf).hexdigest()[:16]
    with open('/tmp/state.tmp', 'w') as f:
        f.write(f'{token} {count} {digest}')
    os.replace('/tmp/state.tmp', '/tmp/state')
    time.sleep(0.05)
"""


def _docker() -> docker.DockerClient:
    subprocess.run(
        ["bash", str(PROJECT_ROOT / "scripts" / "ensure_dockerd.sh")], check=False, capture_output=True
    )
    return docker.from_env(timeout=300)


@pytest.fixture(scope="session")
def docker_client() -> docker.DockerClient:
    return _docker()


@pytest.fixture(scope="session")
def base_image(docker_client: docker.DockerClient) -> str:
    """A base sandbox image: an existing `org.k3rl.image=base` image, else one built from the recipe."""
    found = docker_client.images.list(filters={"label": "org.k3rl.image=base"})
    if found:
        return found[0].id
    tag = "k3rl/base:agentenv-scale-test"
    subprocess.run(["bash", str(PROJECT_ROOT / "sandbox_images" / "base" / "build.sh"), tag], check=True)
    return tag


@pytest.fixture(scope="session")
def fastpath() -> Iterator[FastPath]:
    """A FastPath with its own image store on local disk (removed at the end)."""
    store = Path("/var/tmp") / f"agentenv-scale-test-{uuid.uuid4().hex[:8]}"
    try:
        fp = FastPath(FastPathSettings.load(store_dir=str(store)))
    except FastPathUnavailable as e:
        pytest.skip(f"fast path unavailable on this host: {e}")
    yield fp
    shutil.rmtree(store, ignore_errors=True)


@pytest.fixture
def make_container(docker_client: docker.DockerClient, base_image: str, fastpath: FastPath):
    """Start sandbox-like containers (AgentENV's default profile, root without capabilities)."""
    created: list[str] = []

    def make(program: str = STATE_PROGRAM) -> str:
        volume = f"agentenv-scale-test-{uuid.uuid4().hex[:8]}"
        c = docker_client.containers.run(
            base_image,
            ["python3", "-c", program],
            detach=True,
            network_mode="none",
            read_only=True,
            tmpfs={"/tmp": "size=64m,mode=1777"},
            volumes={volume: {"bind": "/workspace", "mode": "rw"}},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit="256m",
            pids_limit=64,
            user="0",
            labels={TEST_LABEL: TEST_LABEL_VALUE},
        )
        created.append(c.id)
        return c.id

    yield make
    for cid in created:
        fastpath.discard(cid)
        remove_container(docker_client.api, cid)
    for c in docker_client.containers.list(all=True, filters={"label": f"{TEST_LABEL}={TEST_LABEL_VALUE}"}):
        fastpath.discard(c.id)
        remove_container(docker_client.api, c.id)
    for v in docker_client.volumes.list(filters={"dangling": True}):
        if v.name.startswith("agentenv-scale-test-"):
            v.remove(force=True)


@pytest.fixture(scope="session")
def agentenv_scale_home(tmp_path_factory, docker_client, base_image) -> Iterator[Path]:
    """A private $AGENTENV_HOME (registry, locks, pools) for the Sandbox-level tests; its containers and
    volumes are removed at the end."""
    import os

    home = tmp_path_factory.mktemp("agentenv-scale-home").resolve()
    old = os.environ.get("AGENTENV_HOME")
    os.environ["AGENTENV_HOME"] = str(home)
    from agentenv import images

    images.build("base", quiet=True)
    yield home
    if old is None:
        os.environ.pop("AGENTENV_HOME", None)
    else:
        os.environ["AGENTENV_HOME"] = old
    label = f"org.k3rl.agentenv.home={home}"
    for c in docker_client.containers.list(all=True, filters={"label": label}):
        c.remove(force=True, v=True)
    for v in docker_client.volumes.list(filters={"label": label}):
        v.remove(force=True)


@pytest.fixture
def pool_factory(agentenv_scale_home):
    """Pools with small sandboxes; every pool made is closed (members and templates) after the test."""
    from agentenv import SandboxConfig
    from agentenv.pool import SandboxPool

    config = SandboxConfig.load(
        memory="128m",
        pids_limit=64,
        tmpfs={"/tmp": "size=32m,mode=1777"},
        exec_timeout_s=60.0,
        lock_timeout_s=120.0,
    )
    made: list[SandboxPool] = []

    def make(name: str, **overrides) -> SandboxPool:
        pool = SandboxPool(f"{name}-{uuid.uuid4().hex[:6]}", config=config, **overrides)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()
