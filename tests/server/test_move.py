"""A paused sandbox moves between two `agentenv serve` hosts, each in a network namespace of its own with
its own home (registry) and checkpoint store, joined by a veth pair: `agentenv move`, the server's API,
the trainer's resume where memory is free, a refusal, and SIGKILLs of either side in the middle of a move
(crash points, `agentenv.faults`). Whatever happens, the sandbox exists exactly once afterwards, paused
on the source or running on the destination, with its memory (a token and a hash of 24 MiB held by a
process) and its files (one with an extended attribute), and the destination keeps nothing of an import
that did not finish."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from netns_hosts import API_KEY, ROOT, NamespacedServer, linked, namespace, remove_labelled

from agentenv.errors import AgentEnvError, HostUnavailable, ImageError
from agentenv.factory import RemoteSandboxes
from agentenv.remote import RemoteSettings, SandboxHost

pytestmark = pytest.mark.docker

sys.path.insert(0, str(ROOT / "tests" / "agentenv"))
from agentenv_testutil import SMALL  # noqa: E402

HEADERS = {"X-API-Key": API_KEY}
# A process holding 24 MiB of random bytes; on SIGUSR1 it writes its token and their hash (recomputed from
# its memory) to /tmp/echo. Its first line goes to /tmp/tok, read and removed: then only memory holds it.
MEMORY_PROCESS = (
    "nohup python3 -c \"import hashlib,os,signal,time\n"
    "big = os.urandom(24 << 20); tok = os.urandom(8).hex()\n"
    "line = lambda: tok + ' ' + hashlib.sha256(big).hexdigest()\n"
    "signal.signal(signal.SIGUSR1, lambda *a: open('/tmp/echo', 'w').write(line()))\n"
    "open('/tmp/tok', 'w').write(line()); time.sleep(10**6)\" >/dev/null 2>&1 &\n"
    "while [ ! -s /tmp/tok ]; do sleep 0.05; done; cat /tmp/tok; rm /tmp/tok")
ECHO = "rm -f /tmp/echo; pkill -USR1 -x python3; while [ ! -s /tmp/echo ]; do sleep 0.05; done; cat /tmp/echo"
NOTES = ("echo notes > notes.txt && python3 -c \"import os; os.setxattr('notes.txt', 'user.k3rl', b'kept')\"")
READ_NOTES = "cat notes.txt && python3 -c \"import os; print(os.getxattr('notes.txt', 'user.k3rl'))\""


@dataclass
class Hosts:
    a: NamespacedServer  # reports no free memory (memory_reserve_mib): the trainer moves sandboxes off it
    b: NamespacedServer
    stores: dict[str, Path]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[Hosts]:
    from agentenv import SandboxConfig

    base = tmp_path_factory.mktemp("move-hosts").resolve()
    sandbox_conf = base / "sandbox.yaml"
    sandbox_conf.write_text(yaml.safe_dump(SandboxConfig.load(**SMALL).to_dict()))
    backend = yaml.safe_load((ROOT / "conf" / "agentenv" / "backend.yaml").read_text())
    server = yaml.safe_load((ROOT / "conf" / "agentenv" / "server.yaml").read_text())
    stores, envs = {}, {}
    for name, reserve in (("a", 1 << 30), ("b", 0)):
        home = base / name
        home.mkdir()
        stores[name] = Path(f"/var/lib/agentenv/test-move-{os.getpid()}-{name}")
        (home / "backend.yaml").write_text(yaml.safe_dump({**backend, "store_dir": str(stores[name])}))
        (home / "server.yaml").write_text(yaml.safe_dump({**server, "liveness_check_interval_s": 1.0,
                                                          "memory_reserve_mib": reserve}))
        envs[name] = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_API_KEY": API_KEY,
                      "AGENTENV_CONFIG": str(sandbox_conf),
                      "AGENTENV_BACKEND_CONFIG": str(home / "backend.yaml"),
                      "AGENTENV_SERVER_CONFIG": str(home / "server.yaml")}
        envs[name].pop("AGENTENV_SERVER", None)
    subprocess.run([sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"],
                   env=envs["a"], check=True, cwd=ROOT, capture_output=True, timeout=600)
    old_key = os.environ.get("AGENTENV_API_KEY")
    os.environ["AGENTENV_API_KEY"] = API_KEY
    with namespace(0) as (ns_a, ip_a), namespace(1) as (ns_b, ip_b), linked((ns_a, ip_a), (ns_b, ip_b)):
        a = NamespacedServer(base / "a", ns_a, ip_a, envs["a"])
        b = NamespacedServer(base / "b", ns_b, ip_b, envs["b"])
        try:
            a.start()
            b.start()
            yield Hosts(a, b, stores)
        finally:
            for srv in (a, b):
                srv.stop()
                remove_labelled(srv.home)
            for store in stores.values():
                shutil.rmtree(store, ignore_errors=True)
            if old_key is None:
                os.environ.pop("AGENTENV_API_KEY", None)
            else:
                os.environ["AGENTENV_API_KEY"] = old_key


def _wait(what: str, ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.2)


def _host(srv: NamespacedServer) -> SandboxHost:
    return SandboxHost(srv.url, API_KEY, RemoteSettings.load())


def _state(srv: NamespacedServer, sandbox_id: str) -> str | None:
    """The sandbox's state as its server reports it: running, paused, moving, or None (not there)."""
    r = httpx.get(f"{srv.url}/sandboxes/{sandbox_id}", headers=HEADERS, timeout=60)
    if r.status_code == 404:
        return None
    if r.status_code == 409 and "moving" in r.text:
        return "moving"
    assert r.status_code == 200, r.text
    return r.json()["state"]


def _paused_sandbox(srv: NamespacedServer, image: str | None = None) -> tuple[str, str]:
    """A sandbox paused on `srv` with its notes file and memory process: (its id, the process's line)."""
    sb = _host(srv).create(image=image)
    assert sb.exec(NOTES).exit_code == 0
    line = sb.exec(MEMORY_PROCESS).stdout.strip()
    assert len(line) == 16 + 1 + 64, line
    sb.pause()
    return sb.id, line


def _intact(srv: NamespacedServer, sandbox_id: str, line: str) -> None:
    """On `srv` (resumed there if paused): the same process's memory and the same files."""
    sb = _host(srv).get(sandbox_id)
    if sb.status == "paused":
        sb.resume()
    assert sb.exec(ECHO).stdout == line
    assert sb.exec(READ_NOTES).stdout == "notes\nb'kept'\n"


def _labelled(srv: NamespacedServer, sandbox_id: str) -> list[str]:
    """Containers and volumes of `srv`'s home made for the sandbox."""
    flt = ["--filter", f"label=org.k3rl.agentenv.home={srv.home}", "--filter",
           f"label=org.k3rl.agentenv.sandbox={sandbox_id}"]
    out = []
    for kind in (["ps", "-aq"], ["volume", "ls", "-q"]):
        out += subprocess.run(["docker", *kind, *flt], capture_output=True, text=True, timeout=60,
                              check=True).stdout.split()
    return out


def _row(srv: NamespacedServer, sandbox_id: str) -> tuple[str, str | None] | None:
    with sqlite3.connect(srv.home / "registry.sqlite3") as conn:
        return conn.execute("SELECT state, reason FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()


def _stray_images(hosts: Hosts, name: str) -> list[str]:
    """Files in the host's checkpoint store of containers Docker no longer has (the empty folder a failed
    uid probe leaves holds none)."""
    live = set(subprocess.run(["docker", "ps", "-aq", "--no-trunc"], capture_output=True, text=True,
                              timeout=60, check=True).stdout.split())
    store = hosts.stores[name]
    return sorted(str(f) for d in store.iterdir() if d.name not in live for f in d.rglob("*") if f.is_file())


def _nothing_left(hosts: Hosts, name: str, sandbox_id: str) -> None:
    """Host `name` holds nothing of the sandbox: no container, volume, images or live registry row; the
    source's row is closed saying where it went, the destination has none."""
    srv = getattr(hosts, name)
    assert _labelled(srv, sandbox_id) == []
    assert _stray_images(hosts, name) == []
    row = _row(srv, sandbox_id)
    if name == "a":
        assert row == ("closed", f"moved to {hosts.b.url}"), row
        assert not (srv.home / "moves" / f"{sandbox_id}.json").exists()
    else:
        assert row is None, row


def test_a_paused_sandbox_moves_there_and_back_with_its_memory_and_files(hosts):
    sid, line = _paused_sandbox(hosts.a)
    cli = [sys.executable, "-m", "agentenv.cli", "--server", hosts.a.url, "move", sid, "--to", hosts.b.url]
    moved = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env={**os.environ, "AGENTENV_API_KEY": API_KEY})
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout == f"{sid} running on {hosts.b.url}\n"
    assert (_state(hosts.a, sid), _state(hosts.b, sid)) == (None, "running")
    gone = httpx.get(f"{hosts.a.url}/sandboxes/{sid}", headers=HEADERS, timeout=60)
    assert f"moved to {hosts.b.url}" in gone.json()["message"]
    _nothing_left(hosts, "a", sid)
    _intact(hosts.b, sid, line)
    # and back, through the Python API: the handle follows it
    sb = _host(hosts.b).get(sid)
    sb.pause()
    assert sb.move(hosts.a.url) is sb and sb.host.url == hosts.a.url
    assert sb.status == "running" and sb.exec(ECHO).stdout == line
    assert _state(hosts.b, sid) is None and _labelled(hosts.b, sid) == []
    assert _row(hosts.b, sid) == ("closed", f"moved to {hosts.a.url}")
    with pytest.raises(AgentEnvError, match="only a paused sandbox moves"):
        sb.move(hosts.b.url)  # a running one is refused, and stays
    sb.close()


def test_a_sandbox_of_this_machine_moves_with_agentenv_move(hosts, tmp_path):
    """`agentenv move ID --to URL` without `--server`: the source is the CLI's own registry."""
    home = tmp_path / "local"
    home.mkdir()
    (home / "backend.yaml").write_text(hosts.a.home.joinpath("backend.yaml").read_text().replace(
        str(hosts.stores["a"]), str(hosts.stores["a"]) + "-local"))
    env = {**hosts.a.env, "AGENTENV_HOME": str(home), "AGENTENV_BACKEND_CONFIG": str(home / "backend.yaml")}

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "agentenv.cli", *args], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    sid = cli("create").strip()
    try:
        assert cli("exec", sid, "--", "sh", "-c", NOTES) == ""
        line = cli("exec", sid, "--", "sh", "-c", MEMORY_PROCESS).strip()
        cli("pause", sid)
        assert cli("move", sid, "--to", hosts.b.url) == f"{sid} running on {hosts.b.url}\n"
        row = next(r for r in json.loads(cli("ls", "--all", "--json")) if r["id"] == sid)
        assert (row["state"], row["reason"]) == ("closed", f"moved to {hosts.b.url}")
        assert _labelled(NamespacedServer(home, "", "", env), sid) == []
        _intact(hosts.b, sid, line)
        _host(hosts.b).get(sid).close()
    finally:
        subprocess.run([sys.executable, "-m", "agentenv.cli", "rm", sid], env=env, cwd=ROOT, timeout=120,
                       capture_output=True)
        remove_labelled(home)
        shutil.rmtree(str(hosts.stores["a"]) + "-local", ignore_errors=True)


def test_a_destination_without_the_image_refuses_and_the_sandbox_stays(hosts):
    tag = f"k3rl/move-test:{os.getpid()}"
    subprocess.run(["docker", "tag", "k3rl/base:latest", tag], check=True, timeout=60)
    try:
        sid, line = _paused_sandbox(hosts.a, image=tag)
    finally:
        subprocess.run(["docker", "rmi", tag], check=True, timeout=60, capture_output=True)  # B sees no tag
    with pytest.raises(ImageError, match=f"has no image {tag}, which the sandbox runs; load it here"):
        _host(hosts.a).get(sid).move(hosts.b.url)
    assert (_state(hosts.a, sid), _state(hosts.b, sid)) == ("paused", None)
    assert _labelled(hosts.b, sid) == [] and _row(hosts.b, sid) is None
    _intact(hosts.a, sid, line)
    _host(hosts.a).get(sid).close()


def test_a_destination_refuses_more_rights_or_another_criu(hosts):
    """The preflight a move starts with: a config with more rights than B gives its sandboxes, or images of
    another CRIU or kernel, are refused naming what differs (checked by B itself, from the manifest)."""
    from agentenv import SandboxConfig
    from agentenv.backend.transfer import FORMAT, host_facts

    config = SandboxConfig.load(**SMALL).to_dict()
    manifest = {"format": FORMAT, "move_id": "0123456789abcdef", "host": host_facts(),
                "parts": {"images/pages-1.img": 4096},
                "checkpoint": {"format": "tree", "root_pid": 30, "tmpfs": ["/tmp"], "marker": "m",
                               "processes": []},
                "sandbox": {"id": "0123456789ab", "image": "k3rl/base:latest", "user": "root", "labels": {},
                            "config": {**config, "cap_add": ["SYS_ADMIN"], "network": "bridge"}}}
    r = httpx.post(f"{hosts.b.url}/agentenv/imports/check", json=manifest, headers=HEADERS, timeout=60)
    assert r.status_code == 400, r.text
    assert "more rights than this host's sandboxes have: cap_add ['SYS_ADMIN'] (here: [])" in r.text
    assert "network 'bridge' (here: 'none')" in r.text
    manifest["sandbox"]["config"] = config
    assert httpx.post(f"{hosts.b.url}/agentenv/imports/check", json=manifest, headers=HEADERS,
                      timeout=60).json() == {"ok": True}
    manifest["host"] = {**host_facts(), "criu": "3.17"}
    r = httpx.post(f"{hosts.b.url}/agentenv/imports/check", json=manifest, headers=HEADERS, timeout=60)
    assert r.status_code == 503 and "criu '3.17' there" in r.text, r.text


def test_the_trainer_resumes_a_paused_sandbox_on_a_host_with_free_memory(hosts):
    """A reports no free memory (its memory_reserve_mib), so the lease of a sandbox paused there moves it
    to B, which resumes it; paused on B, which has room, it resumes in place."""
    factory = RemoteSandboxes([hosts.a.url, hosts.b.url])
    assert factory.hosts.hosts[0].info()["memAvailableBytes"] == 0
    sid, line = _paused_sandbox(hosts.a)
    sb = _host(hosts.a).get(sid)
    with factory.lease(sb) as held:
        assert held is sb and sb.host.url == hosts.b.url
        assert sb.exec(ECHO).stdout == line
    assert (_state(hosts.a, sid), _state(hosts.b, sid)) == (None, "running")
    sb.pause()
    with factory.lease(sb):
        assert sb.host.url == hosts.b.url and sb.status == "running"
    sb.close()


@pytest.mark.slow
@pytest.mark.parametrize(("killed", "point", "ends_on"), [
    ("a", "move-streaming", "a"),     # the source dies with half the stream sent
    ("a", "move-confirmed", "b"),     # the source dies after the answer, before it removes its own copy
    ("b", "import-streaming", "a"),   # the destination dies with half the stream in
    ("b", "import-restored", "a"),    # ... after its verified restore, before its commit
    ("b", "import-committed", "b"),   # ... after its commit, before its answer
])
def test_a_kill_of_either_side_mid_move_leaves_the_sandbox_exactly_once(hosts, killed, point, ends_on):
    victim = getattr(hosts, killed)
    victim.stop()
    victim.start(AGENTENV_FAULT=point)
    try:
        sid, line = _paused_sandbox(hosts.a)
        with pytest.raises(HostUnavailable):
            _host(hosts.a).get(sid).move(hosts.b.url)
        assert victim.proc.wait(timeout=60) == -9, victim.log.read_text()[-2000:]
    finally:
        victim.stop()
        victim.start()
    _wait("the source settled the move", lambda: _state(hosts.a, sid) != "moving")
    where = {"a": _state(hosts.a, sid), "b": _state(hosts.b, sid)}
    assert where == ({"a": "paused", "b": None} if ends_on == "a" else {"a": None, "b": "running"}), where
    _nothing_left(hosts, "b" if ends_on == "a" else "a", sid)
    assert list((hosts.a.home / "moves").glob(f"{sid}*")) == []  # neither its journal entry nor archives
    if ends_on == "a":  # the destination recorded the move as failed
        entries = [p.read_text() for p in (hosts.b.home / "imports").glob("*.json")]
        assert any(f'"sandbox_id": "{sid}"' in e and '"state": "failed"' in e for e in entries), entries
    holder = getattr(hosts, ends_on)
    _intact(holder, sid, line)
    _host(holder).get(sid).close()
