"""`agentenv serve` when things die under it, driven by the real `e2b` SDK: the server itself (kill -9 in
the middle of requests, then a restart on the same home; a second server on that home is refused),
dockerd (restarted mid-load), the checkpoint store (over its disk cap) and a sandbox's container (killed
or removed behind the server's back).

One server for the module, in a private $AGENTENV_HOME with small sandboxes and a 1 s liveness sweep;
tests restart it (kill -9, or with another backend config) and leave it running for the next.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from netns_hosts import API_KEY, ROOT, _free_port, remove_labelled, wait_healthy

pytestmark = pytest.mark.docker

sys.path.insert(0, str(ROOT / "tests" / "agentenv"))
from agentenv_testutil import SMALL  # noqa: E402
from dockerd_restart import dockerd_pid, restart_blockers, restart_dockerd  # noqa: E402

CALL_TIMEOUT_S = 30  # every SDK call of these tests (request_timeout): nothing may hang


@dataclass
class Served:
    """`agentenv serve` on a fixed loopback port and home, which a test may kill -9 and start again."""

    home: Path
    env: dict[str, str]
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.home / "server.log"

    def start(self, **extra_env: str) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agentenv.cli", "serve", "--port", str(self.port)],
                env={**self.env, **extra_env}, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(self.url, self.proc, self.log)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill9()

    def live_rows(self) -> int:
        """Registry rows of this home that are not closed (creating, running, paused, broken); spare shells,
        made ahead for forks in the background (agentenv.spares), are not sandboxes anyone holds."""
        with sqlite3.connect(self.home / "registry.sqlite3") as conn:
            return conn.execute("SELECT count(*) FROM sandboxes WHERE state NOT IN ('closed', 'spare')"
                                ).fetchone()[0]

    def containers(self) -> list[str]:
        """Docker containers (any state) labelled with this home."""
        label = f"label=org.k3rl.agentenv.home={self.home}"
        return subprocess.run(["docker", "ps", "-aq", "--filter", label],
                              capture_output=True, text=True, timeout=60, check=True).stdout.split()

    def checkpoint_dirs(self) -> list[Path]:
        """Checkpoint folders in the store of any container this home ever had."""
        from agentenv.backend.settings import BackendSettings

        store = Path(BackendSettings.load().store_dir)
        with sqlite3.connect(self.home / "registry.sqlite3") as conn:
            rows = conn.execute("SELECT container FROM sandboxes WHERE container IS NOT NULL").fetchall()
        containers = [r[0] for r in rows]
        return [store / c for c in containers if (store / c).is_dir() and any((store / c).iterdir())]

    def container_of(self, sandbox_id: str) -> str:
        label = f"label=org.k3rl.agentenv.sandbox={sandbox_id}"
        out = subprocess.run(["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()
        assert len(out) == 1, out
        return out[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """The module's server, with the E2B SDK's environment pointed at it (restored at the end)."""
    home = tmp_path_factory.mktemp("agentenv-serve-faults").resolve()
    sandbox_conf = home / "sandbox.yaml"
    from agentenv import SandboxConfig

    sandbox_conf.write_text(yaml.safe_dump(SandboxConfig.load(**SMALL).to_dict()))
    server_conf = home / "server.yaml"
    conf = yaml.safe_load((ROOT / "conf" / "agentenv" / "server.yaml").read_text())
    server_conf.write_text(yaml.safe_dump({**conf, "liveness_check_interval_s": 1.0}))
    env = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_API_KEY": API_KEY,
           "AGENTENV_CONFIG": str(sandbox_conf), "AGENTENV_SERVER_CONFIG": str(server_conf)}
    env.pop("AGENTENV_SERVER", None)
    subprocess.run([sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"], env=env,
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    srv = Served(home, env)
    old = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=API_KEY)
    os.environ.pop("E2B_DOMAIN", None)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        remove_labelled(home)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sdk():
    from e2b import Sandbox

    return Sandbox


def _make(n: int, paused: int = 0) -> list[tuple[object, str, str]]:
    """n SDK sandboxes, each with a file naming it; the first `paused` are paused. (sandbox, its mark
    text, the state it was left in)."""
    out = []
    for i in range(n):
        sbx = _sdk().create("base", timeout=600, request_timeout=CALL_TIMEOUT_S)
        mark = f"sandbox {i}: {sbx.sandbox_id}\n"
        sbx.files.write("mark.txt", mark, request_timeout=CALL_TIMEOUT_S)
        if i < paused:
            sbx.pause(request_timeout=CALL_TIMEOUT_S)
        out.append((sbx, mark, "paused" if i < paused else "running"))
    return out


def _listed() -> dict[str, str]:
    pages = _sdk().list(limit=100, request_timeout=CALL_TIMEOUT_S)
    out = {}
    for _ in range(10):
        for info in pages.next_items():
            out[info.sandbox_id] = str(getattr(info.state, "value", info.state))
        if not pages.has_next:
            break
    return out


def _usable(sandbox_id: str, mark: str | None) -> None:
    """connect (resumes a paused one) + a command that reads the sandbox's file (``mark``; None: a write
    the kill cut off, which may or may not have happened), then a write."""
    sbx = _sdk().connect(sandbox_id, timeout=600, request_timeout=CALL_TIMEOUT_S)
    if mark is not None:
        assert sbx.commands.run("cat mark.txt", request_timeout=CALL_TIMEOUT_S).stdout == mark
    sbx.files.write("after.txt", "ok", request_timeout=CALL_TIMEOUT_S)
    assert sbx.files.read("after.txt", request_timeout=CALL_TIMEOUT_S) == "ok"


def _kill_all_listed() -> None:
    for sid in _listed():
        _sdk().kill(sid, request_timeout=CALL_TIMEOUT_S)


def _assert_nothing_left(srv: Served) -> None:
    assert srv.live_rows() == 0, "registry rows left"
    assert srv.containers() == [], "containers left"
    assert srv.checkpoint_dirs() == [], "checkpoint folders left"


@dataclass
class Load:
    """Client threads looping SDK calls until `stop`; every outcome is kept (op, seconds, error or None)
    and every sandbox a loop made and did not kill is in `made`."""

    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[tuple[str, float, BaseException | None]] = field(default_factory=list)
    made: dict[str, str | None] = field(default_factory=dict)  # id -> its mark (None: write unanswered)
    threads: list[threading.Thread] = field(default_factory=list)

    def call(self, op: str, fn: Callable[[], object]) -> object:
        t = time.monotonic()
        try:
            out = fn()
        except Exception as e:
            self.outcomes.append((op, time.monotonic() - t, e))
            raise
        self.outcomes.append((op, time.monotonic() - t, None))
        return out

    def loop(self, body: Callable[[Load], None]) -> None:
        def run() -> None:
            while not self.stop.is_set():
                try:
                    body(self)
                except Exception:  # recorded in outcomes; go on until told to stop
                    time.sleep(0.2)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=CALL_TIMEOUT_S * 4)
            assert not t.is_alive(), "a client call hung"


def _cycle(load: Load) -> None:
    """create -> run -> pause -> connect -> run -> kill, as the load bench's clients do."""
    S = _sdk()
    sbx = load.call("create", lambda: S.create("base", timeout=600, request_timeout=CALL_TIMEOUT_S))
    mark = f"{sbx.sandbox_id}\n"
    load.made[sbx.sandbox_id] = None  # made; its mark is its own once the write was answered
    load.call("write", lambda: sbx.files.write("mark.txt", mark, request_timeout=CALL_TIMEOUT_S))
    load.made[sbx.sandbox_id] = mark
    load.call("pause", lambda: sbx.pause(request_timeout=CALL_TIMEOUT_S))
    again = load.call("connect", lambda: S.connect(sbx.sandbox_id, timeout=600,
                                                   request_timeout=CALL_TIMEOUT_S))
    load.call("run", lambda: again.commands.run("cat mark.txt", request_timeout=CALL_TIMEOUT_S))
    load.call("kill", lambda: again.kill(request_timeout=CALL_TIMEOUT_S))
    load.made.pop(sbx.sandbox_id)


def _commands(sbx) -> Callable[[Load], None]:
    def body(load: Load) -> None:
        load.call("run", lambda: sbx.commands.run("sleep 0.2; echo x", request_timeout=CALL_TIMEOUT_S))
    return body


def _server_failure(e: BaseException) -> bool:
    """An error a server sends for its own bug: an HTTP 500 or a Connect `internal` / `unknown`."""
    text = str(e)
    return getattr(e, "status_code", None) == 500 or text.startswith(("Code.INTERNAL", "Code.UNKNOWN")) \
        or "internal error" in text


# ---- the tests -----------------------------------------------------------------------------------
def test_a_sandbox_whose_container_died_is_reported_gone_not_as_a_500(served):
    from e2b.exceptions import NotFoundException

    (killed, _m, _), (removed, _m2, _) = _make(2)
    for verb, sbx in ((["kill"], killed), (["rm", "-f"], removed)):
        subprocess.run(["docker", *verb, served.container_of(sbx.sandbox_id)], check=True,
                       capture_output=True)

    with pytest.raises(NotFoundException, match=r"gone.*exit code 137"):
        killed.commands.run("true", request_timeout=CALL_TIMEOUT_S)
    assert not killed.is_running(request_timeout=CALL_TIMEOUT_S)
    # the one nobody asked about: the liveness sweep (1 s here) drops it from the list
    deadline = time.monotonic() + 10
    while removed.sandbox_id in _listed() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert set(_listed()).isdisjoint({killed.sandbox_id, removed.sandbox_id})
    # the control plane says why, to every later request too (the record is gone)
    headers = {"X-API-Key": API_KEY}
    for sid, why in ((killed.sandbox_id, "exit code 137"), (removed.sandbox_id, "container was removed")):
        r = httpx.get(f"{served.url}/sandboxes/{sid}", headers=headers, timeout=CALL_TIMEOUT_S)
        assert r.status_code == 404 and "gone" in r.json()["message"] and why in r.json()["message"], r.text
    assert "Traceback" not in served.log.read_text()
    _assert_nothing_left(served)


def test_kill_9_of_the_server_mid_load_then_a_restart(served):
    from e2b.exceptions import SandboxUnreachableException

    stable = _make(3, paused=2)
    load = Load()
    load.loop(_cycle)
    load.loop(_cycle)
    load.loop(_commands(stable[2][0]))  # one that must come back is in the middle of commands
    time.sleep(2)  # the loops are mid-request
    served.kill9()
    load.join()  # every call in flight ended (raised), none hung
    failed = [(op, e) for op, _s, e in load.outcomes if e is not None]
    assert failed, "no request was in flight at the kill"
    assert not [e for _op, e in failed if _server_failure(e)], failed
    # the connection broke: httpx's transport error (control plane), the SDK's "unreachable" (streams)
    assert all(isinstance(e, (httpx.TransportError, SandboxUnreachableException, ConnectionError))
               for _op, e in failed), failed

    # a resume that outlived its server: the container of a sandbox recorded paused runs again
    subprocess.run(["docker", "start", served.container_of(stable[0][0].sandbox_id)], check=True,
                   capture_output=True, timeout=60)
    served.start()
    listed = _listed()
    for sbx, mark, state in stable:  # every sandbox that existed is back, in its state, and usable
        assert listed.get(sbx.sandbox_id) == state, (sbx.sandbox_id, listed)
        _usable(sbx.sandbox_id, mark)
    for sid, mark in load.made.items():  # a loop's sandbox: back and usable, or gone (never half there)
        if sid in listed:
            _usable(sid, mark)
    _kill_all_listed()
    _assert_nothing_left(served)


@pytest.mark.serial  # stops every running container: the other lane's too
def test_dockerd_restarted_mid_load(served, tmp_path_factory):
    from e2b.exceptions import NotFoundException, SandboxException

    from agentenv.backend import docker_client
    from agentenv.backend.base import LABEL_HOME

    # This test session's own containers (other fixtures' homes under its basetemp) are its own to stop;
    # the rest decides as in tests/agentenv/test_agentenv_host.py. Not a skip: on the machine `make test`
    # runs on, nothing else uses dockerd, and a restart would stop those containers.
    base = tmp_path_factory.getbasetemp().resolve()
    others = [c for c in docker_client.api().containers()
              if not Path((c.get("Labels") or {}).get(LABEL_HOME, "/")).is_relative_to(base)]
    blockers = restart_blockers(others, served.home)
    assert not blockers, (f"running container(s) {', '.join(blockers)} are not this test's nor leftovers "
                          "of a finished test session; a dockerd restart would stop them")
    sandboxes = _make(4, paused=2)
    load = Load()
    load.loop(_commands(sandboxes[3][0]))
    time.sleep(1)
    restart_dockerd(dockerd_pid(), ROOT / "scripts" / "ensure_dockerd.sh")
    load.join()
    assert not [e for _op, _s, e in load.outcomes if e is not None and _server_failure(e)]

    for sbx, mark, state in sandboxes:
        if state == "paused":  # their images are on disk: they resume
            _usable(sbx.sandbox_id, mark)
            continue
        try:  # running ones survive, or are gone with a clear error
            _usable(sbx.sandbox_id, mark)
        except (NotFoundException, SandboxException) as e:
            assert "not found" in str(e).lower() or "gone" in str(e), e
            assert not _server_failure(e), e
            r = httpx.get(f"{served.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": API_KEY},
                          timeout=CALL_TIMEOUT_S)
            assert r.status_code == 404 and "gone" in r.json()["message"], r.text
            assert sbx.sandbox_id not in _listed()
    _kill_all_listed()
    _assert_nothing_left(served)


def test_a_second_server_on_the_same_home_is_refused(served):
    """Start-up recovery settles what a dead server left, so it must never run beside a live one: the
    home's lock, taken here as a second `agentenv serve` would, is refused naming the live server."""
    from agentenv.errors import ConfigError
    from agentenv.server.serve import hold_home

    with pytest.raises(ConfigError) as info:
        hold_home(served.home)
    assert str(info.value) == (f"another agentenv serve (pid {served.proc.pid}) already serves the "
                               f"sandboxes of {served.home}; stop it, or give this one another "
                               "$AGENTENV_HOME")


def test_a_pause_over_the_disk_cap_is_refused_and_the_sandbox_keeps_running(served, tmp_path):
    from e2b.exceptions import SandboxException

    from agentenv.backend.settings import BackendSettings

    conf = yaml.safe_load((ROOT / "conf" / "agentenv" / "backend.yaml").read_text())
    conf["disk_cap"] = "1m"  # below any checkpoint
    capped = tmp_path / "backend.yaml"
    capped.write_text(yaml.safe_dump(conf))
    assert BackendSettings.load(capped).disk_cap == 2**20  # a typed key of the backend's config
    served.stop()  # the module's last test: the server stays capped until the module's teardown
    served.start(AGENTENV_BACKEND_CONFIG=str(capped))
    [(sbx, mark, _)] = _make(1)
    # each count lands whole (written aside, then renamed): a read never sees the file truncated
    sbx.commands.run("nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > n.new; mv n.new n.txt; sleep 0.1; "
                     "done' "
                     ">/dev/null 2>&1 &", request_timeout=CALL_TIMEOUT_S)
    with pytest.raises(SandboxException, match=r"507: .*1 MiB cap \(disk_cap in conf/agentenv/backend"):
        sbx.pause(request_timeout=CALL_TIMEOUT_S)
    assert sbx.get_info(request_timeout=CALL_TIMEOUT_S).state.value == "running"
    assert sbx.files.read("mark.txt", request_timeout=CALL_TIMEOUT_S) == mark
    before = int(sbx.files.read("n.txt", request_timeout=CALL_TIMEOUT_S))
    time.sleep(0.5)
    assert int(sbx.files.read("n.txt", request_timeout=CALL_TIMEOUT_S)) > before  # still counting
    sbx.kill(request_timeout=CALL_TIMEOUT_S)
    _assert_nothing_left(served)
