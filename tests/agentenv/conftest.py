"""Fixtures for the AgentENV tests: a real Docker daemon (started when none answers), the base image
(built when missing), and a private $AGENTENV_HOME whose containers, volumes and checkpoint images are
removed at the end even when tests fail."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentenv_testutil import ROOT, SMALL, run_cli
from dockerd_restart import hold_session_lock

sys.path.insert(0, str(ROOT / "tests" / "server"))
from netns_hosts import remove_labelled  # noqa: E402


def _docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def ensure_dockerd() -> None:
    if not _docker_answers():
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_dockerd.sh")], check=True)
    from agentenv.backend import docker_client

    docker_client.reset()


@pytest.fixture(scope="session")
def agentenv_home(tmp_path_factory) -> Iterator[Path]:
    """A private registry for this test session; everything labelled with it is removed at the end."""
    home = tmp_path_factory.mktemp("agentenv-home")
    session_lock = hold_session_lock(home)  # tells a dockerd-restarting test that this session is live
    old = os.environ.get("AGENTENV_HOME")
    os.environ["AGENTENV_HOME"] = str(home)
    yield home
    os.close(session_lock)
    if old is None:
        os.environ.pop("AGENTENV_HOME", None)
    else:
        os.environ["AGENTENV_HOME"] = old
    remove_labelled(home)


@pytest.fixture(scope="session")
def docker_ready(agentenv_home) -> None:
    ensure_dockerd()


@pytest.fixture(scope="session")
def base_image(docker_ready) -> str:
    from agentenv.backend import images

    return images.build("base", quiet=True).tag


@pytest.fixture
def small_config(base_image):
    from agentenv import SandboxConfig

    return SandboxConfig.load(**SMALL)


@pytest.fixture
def make_sandbox(small_config):
    """Factory: sandboxes with the small config (overrides as keywords), closed after the test."""
    from agentenv import Sandbox

    made = []

    def make(**overrides):
        sb = Sandbox.create(config=small_config.replace(**overrides))
        made.append(sb)
        return sb

    yield make
    for sb in made:
        for s in [sb, *Sandbox.list()]:
            if s.parent_id == sb.id or s.id == sb.id:
                s.close()


@pytest.fixture
def sandbox(make_sandbox):
    return make_sandbox()


@pytest.fixture
def cli(agentenv_home):
    return run_cli
