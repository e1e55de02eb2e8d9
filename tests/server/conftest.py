"""Fixtures for `agentenv serve` tests: a real Docker daemon and base image, a private $AGENTENV_HOME, and
the server itself started as `agentenv serve` in a subprocess on a free loopback port, with the
unmodified `e2b` SDK pointed at it through E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from netns_hosts import remove_labelled

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "e2b_" + "5e" * 20


@dataclass(frozen=True)
class Server:
    url: str
    api_key: str
    home: Path
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """`agentenv serve` on a free port with a private home; its sandboxes are removed at the end."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_dockerd.sh")], check=True)
    home = tmp_path_factory.mktemp("agentenv-serve-home")
    env = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_API_KEY": API_KEY}
    subprocess.run([sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"], env=env,
                   check=True, cwd=ROOT, capture_output=True)
    port = _free_port()
    log = home / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentenv.cli", "serve", "--port", str(port)], env=env,
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 204:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"agentenv serve did not come up: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    old = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=API_KEY)
    os.environ.pop("E2B_DOMAIN", None)
    try:
        yield Server(url, API_KEY, home, log)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        remove_labelled(home)


@pytest.fixture
def sdk_sandbox(server) -> Iterator:
    """Factory of SDK sandboxes (`e2b.Sandbox.create` keyword arguments), killed after the test."""
    from e2b import Sandbox

    made = []

    def make(template: str = "base", **kw):
        sb = Sandbox.create(template, **kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        try:
            sb.kill()
        except Exception:
            pass
