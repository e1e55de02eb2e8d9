"""Sandbox hosts for the tests: `agentenv serve` on a free loopback port (`loopback_server`), or inside a
network namespace of its own (`namespaced_host`), reached over a veth pair with private addresses only
these tests use (10.231.N.4k+1/30 here, .4k+2 there, N from the pid so parallel runs do not collide, k the
host's index). Imported by name by the tests that need remote hosts (tests/server puts this folder on
sys.path; others insert it)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "e2b_" + "5e" * 20
PORT = 3000


@dataclass(frozen=True)
class Server:
    """A running `agentenv serve` on loopback: its URL, API key, private home and log."""

    url: str
    api_key: str
    home: Path
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_dockerd() -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_dockerd.sh")], check=True)


@dataclass
class NamespacedHost:
    """One running `agentenv serve` in its namespace: its URL, process, private home and log."""

    url: str
    proc: subprocess.Popen
    home: Path
    log: Path
    namespace: str


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()}")


@contextlib.contextmanager
def namespace(index: int = 0) -> Iterator[tuple[str, str]]:
    """A fresh network namespace joined to this one by a veth pair; yields (namespace, its address);
    removed at the end, even on failure."""
    pid, n = os.getpid(), os.getpid() % 250
    ns, host_if, ns_if = f"k3rl-remote-{pid}-{index}", f"k3rh{pid}{index}", f"k3rn{pid}{index}"
    host_ip, ns_ip = f"10.231.{n}.{4 * index + 1}", f"10.231.{n}.{4 * index + 2}"
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


@contextlib.contextmanager
def linked(a: tuple[str, str], b: tuple[str, str]) -> Iterator[None]:
    """A veth pair straight between two namespaces (`a`, `b`: (namespace, its address) from `namespace`),
    and in each a route to the other's address over it: their servers reach each other at the addresses
    these tests reach them at, as machines of one network would, with no forwarding in this namespace."""
    (ns_a, ip_a), (ns_b, ip_b) = a, b
    if_a, if_b = f"k3rla{os.getpid()}", f"k3rlb{os.getpid()}"
    _ip("link", "add", if_a, "type", "veth", "peer", "name", if_b)
    try:
        for ns, ifname, peer in ((ns_a, if_a, ip_b), (ns_b, if_b, ip_a)):
            _ip("link", "set", ifname, "netns", ns)
            _ip("netns", "exec", ns, "ip", "link", "set", ifname, "up")
            _ip("netns", "exec", ns, "ip", "route", "add", f"{peer}/32", "dev", ifname)
        yield
    finally:  # deleting one end deletes the pair, wherever it is
        for where, ifname in ((["ip", "netns", "exec", ns_a], if_a), ([], if_a), ([], if_b)):
            subprocess.run([*where, "ip", "link", "del", ifname], capture_output=True, timeout=30)


@dataclass
class NamespacedServer:
    """`agentenv serve --host ADDRESS` in network namespace `namespace`, with its own home and environment,
    which a test may kill -9 and start again (with extra environment, e.g. `$AGENTENV_FAULT`)."""

    home: Path
    namespace: str
    address: str
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{PORT}"

    @property
    def log(self) -> Path:
        return self.home / "server.log"

    def start(self, **extra_env: str) -> None:
        argv = ["nsenter", f"--net=/var/run/netns/{self.namespace}", "--", sys.executable, "-m",
                "agentenv.cli", "serve", "--host", self.address, "--port", str(PORT)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, env={**self.env, **extra_env}, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT)
        wait_healthy(self.url, self.proc, self.log)

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


def remove_labelled(home: Path) -> None:
    """Remove the containers, volumes and checkpoint images of the sandboxes made with this
    $AGENTENV_HOME (`agentenv gc` deletes the images of containers Docker no longer has)."""
    label = f"label=org.k3rl.agentenv.home={home.resolve()}"
    for kind in (["ps", "-aq"], ["volume", "ls", "-q"]):
        ids = subprocess.run(["docker", *kind, "--filter", label], capture_output=True, text=True,
                             timeout=60).stdout.split()
        if ids:
            rm = ["docker", "rm", "-f"] if kind[0] == "ps" else ["docker", "volume", "rm", "-f"]
            subprocess.run([*rm, *ids], capture_output=True, timeout=120)
    env = {**os.environ, "AGENTENV_HOME": str(home)}
    subprocess.run([sys.executable, "-m", "agentenv.cli", "gc"], env=env, cwd=ROOT, capture_output=True,
                   timeout=120)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 204:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"agentenv serve at {url} did not come up: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.contextmanager
def loopback_server(home: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`agentenv serve` on a free loopback port with its own $AGENTENV_HOME (`home`, created) and `env` on
    top of this process's environment (e.g. `AGENTENV_CONFIG` for its sandboxes' config); stopped and its
    sandboxes removed at the end."""
    _ensure_dockerd()
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_API_KEY": API_KEY, **(env or {})}
    env.pop("AGENTENV_SERVER", None)
    subprocess.run([sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"], env=env,
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    port = _free_port()
    log = home / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentenv.cli", "serve", "--port", str(port)], env=env,
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield Server(url, API_KEY, home, log)
    finally:
        _stop(proc)
        remove_labelled(home)


@contextlib.contextmanager
def namespaced_host(home: Path, index: int = 0) -> Iterator[NamespacedHost]:
    """`agentenv serve --host <namespace address>` with its own $AGENTENV_HOME (`home`, created) inside
    namespace `index`; stopped, its sandboxes removed and the namespace deleted at the end."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_API_KEY": API_KEY}
    env.pop("AGENTENV_SERVER", None)
    subprocess.run([sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"], env=env,
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    with namespace(index) as (ns, ns_ip):
        log = home / "server.log"
        with open(log, "wb") as out:
            # only the network namespace (`ip netns exec` would also mount a /sys without cgroups): the
            # server sees the host's file systems, as it would on a host of its own
            proc = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{ns}", "--", sys.executable, "-m",
                                     "agentenv.cli", "serve", "--host", ns_ip, "--port", str(PORT)], env=env,
                                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://{ns_ip}:{PORT}"
        try:
            wait_healthy(url, proc, log)
            yield NamespacedHost(url, proc, home, log, ns)
        finally:
            _stop(proc)
            remove_labelled(home)
