"""A task whose sandbox lives on another host: `agentenv serve` runs in a network namespace of its own
(reached over a veth pair with private addresses only this test uses), the default task
`agentenv/GuessNumber-v0` is built with `sandbox={"hosts": [url]}` and played to the end by its scripted
expert, then the host is killed and the next episode fails with a clear error within bounded time."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import gymnasium as gym
import httpx
import pytest
from netns_hosts import API_KEY, PORT, namespaced_host

import agentenv.tasks  # noqa: F401  (registers agentenv/* envs)
from agentenv.remote import HostUnavailable, RemoteSandbox, SandboxHosts
from rl.sft.experts import expert_for

pytestmark = [pytest.mark.docker]
ENV_ID = "agentenv/GuessNumber-v0"


@pytest.fixture
def remote_host(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`agentenv serve --host <namespace address>` inside its own network namespace: (url, process)."""
    with namespaced_host(tmp_path / "remote-home") as host:
        # Not on this namespace's loopback: only the veth address reaches it.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2)
        yield host.url, host.proc


def _play(env: gym.Env, seed: int) -> tuple[float, bool, int]:
    """One episode with the scripted bisection expert: (return, success, turns)."""
    expert = expert_for(ENV_ID)
    obs, _info = env.reset(seed=seed)
    expert.start(obs)
    total, turns = 0.0, 0
    while True:
        obs, reward, terminated, truncated, info = env.step(expert.act(obs))
        total, turns = total + reward, turns + 1
        if terminated or truncated:
            return total, bool(info["success"]), turns


def test_task_sandbox_on_a_host_in_another_network_namespace(remote_host, monkeypatch):
    url, server = remote_host
    monkeypatch.setenv("AGENTENV_API_KEY", API_KEY)
    env = gym.make(ENV_ID, sandbox={"hosts": [url]}).unwrapped
    try:
        for seed in (3, 11):
            total, success, turns = _play(env, seed)
            assert success and total == 1.0 and turns <= env.max_turns, (seed, total, turns)
        assert isinstance(env.sandbox, RemoteSandbox) and env.sandbox.host.url == url
        assert env.sandbox.describe()["state"] == "running"
        hosts = SandboxHosts([url])
        assert hosts.host_of(env.sandbox.id).url == url and hosts.pick().info()["running"] == 1

        # The task's fork and pause go through the host too.
        env.reset(seed=5)
        [child] = env.fork(1)
        assert isinstance(child.sandbox, RemoteSandbox) and child.sandbox.parent_id == env.sandbox.id
        child.close()
        env.pause()
        assert env.paused
        total, success, _turns = _play(env, 5)  # reset resumes it
        assert success and total == 1.0

        server.send_signal(signal.SIGKILL)
        server.wait(timeout=15)
        started = time.monotonic()
        with pytest.raises(HostUnavailable, match=f"sandbox host {url} did not answer"):
            _play(env, 7)
        assert time.monotonic() - started < 30
    finally:
        env.sandbox = None  # its host is gone (or closes it below): nothing local to close
        env.close()
