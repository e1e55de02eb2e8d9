"""A task whose sandbox lives on another host: `agentenv serve` runs in a network namespace of its own
(reached over a veth pair with private addresses only this test uses), the default task
`agentenv/GuessNumber-v0` is built with `sandbox={"hosts": [url]}` and played to the end by its scripted
expert, then the host is killed and the next episode fails with a clear error within bounded time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import gymnasium as gym
import httpx
import pytest
from conftest import API_KEY, ROOT, _remove_labelled

import agentenv.tasks  # noqa: F401  (registers agentenv/* envs)
from agentenv.remote import HostUnavailable, RemoteSandbox, SandboxHosts
from agentenv.tasks.experts import expert_for

pytestmark = [pytest.mark.docker]
ENV_ID = "agentenv/GuessNumber-v0"
PORT = 3000


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()}")


@contextlib.contextmanager
def _namespace() -> Iterator[tuple[str, str]]:
    """A fresh network namespace joined to this one by a veth pair on 10.231.N.0/30 (N from the pid, so
    parallel runs do not collide); yields (namespace, its address); removed at the end, even on failure."""
    n = os.getpid() % 250
    ns, host_if, ns_if = f"k3rl-remote-{os.getpid()}", f"k3rh{os.getpid()}", f"k3rn{os.getpid()}"
    host_ip, ns_ip = f"10.231.{n}.1", f"10.231.{n}.2"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        for args in (("addr", "add", f"{ns_ip}/30", "dev", ns_if), ("link", "set", ns_if, "up"),
                     ("link", "set", "lo", "up")):
            _ip("netns", "exec", ns, "ip", *args)
        yield ns, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def remote_host(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`agentenv serve --host <namespace address>` inside its own network namespace: (url, process)."""
    home = tmp_path / "remote-home"
    home.mkdir()
    env = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_API_KEY": API_KEY}
    env.pop("AGENTENV_SERVER", None)
    subprocess.run([sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"], env=env,
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    with _namespace() as (ns, ns_ip):
        log = home / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "agentenv.cli", "serve",
                                     "--host", ns_ip, "--port", str(PORT)], env=env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT)
        url = f"http://{ns_ip}:{PORT}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 204:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"agentenv serve did not come up in namespace {ns}: "
                                f"{log.read_text()[-2000:]}")
                time.sleep(0.2)
            # Not on this namespace's loopback: only the veth address reaches it.
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2)
            yield url, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            _remove_labelled(home)


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
