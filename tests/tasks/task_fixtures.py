"""Fixtures shared by the task and trainer tests: a real Docker daemon, the base sandbox image, and a
private $AGENTENV_HOME whose containers, volumes and checkpoint images are removed at the end (even when
tests fail).

Imported by tests/tasks/conftest.py and tests/rl/conftest.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from netns_hosts import remove_labelled  # noqa: E402

# Small sandboxes: the whole suite shares 2 cores.
SANDBOX = {
    "memory": "128m",
    "cpus": 1.0,
    "pids_limit": 64,
    "tmpfs": {"/tmp": "size=32m,mode=1777"},
    "exec_timeout_s": 30.0,
    "lock_timeout_s": 60.0,
}


@pytest.fixture(scope="session")
def task_home(tmp_path_factory) -> Iterator[Path]:
    """A private AgentENV registry, set before any sandbox (or Ray worker) starts. The local Ray clusters
    the tests start (in this process, or through `python -m rl.train`) go without Ray's token
    authentication, which adds about 1.2 s to every `ray.init` here (a few dozen in the suite); the
    multi-node tests (tests/rl/ray_cluster.py) set RAY_AUTH_MODE=token on every node and driver, as
    docs/training.md tells a user to."""
    home = tmp_path_factory.mktemp("agentenv-home-tasks")
    old, old_auth = os.environ.get("AGENTENV_HOME"), os.environ.get("RAY_AUTH_MODE")
    os.environ["AGENTENV_HOME"] = str(home)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_dockerd.sh")], check=True)
    from agentenv.backend import images

    images.build("base", quiet=True)
    yield home
    remove_labelled(home)
    for name, value in (("AGENTENV_HOME", old), ("RAY_AUTH_MODE", old_auth)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def sandbox_config(task_home) -> dict:
    """The full sandbox config (conf/sandbox/default.yaml) with the small test limits, as a dict."""
    from agentenv import SandboxConfig

    return SandboxConfig.load(**SANDBOX).to_dict()


@pytest.fixture
def make_task(sandbox_config):
    """Factory: a built-in task env by id (keyword overrides), closed after the test; its sandboxes come
    from `agentenv.factory.sandbox_factory` (this machine's, unless `sandboxes=` says otherwise)."""
    import gymnasium

    import agentenv.tasks  # noqa: F401

    made = []

    def make(env_id: str, **kwargs):
        from agentenv.factory import sandbox_factory

        kwargs.setdefault("sandbox", {"config": sandbox_config})
        kwargs.setdefault("sandboxes", sandbox_factory(kwargs["sandbox"]))  # local, or the given hosts
        env = gymnasium.make(env_id, **kwargs).unwrapped
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()
