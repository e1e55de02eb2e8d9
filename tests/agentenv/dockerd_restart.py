"""Restarting the Docker daemon from a test, safely: who else would it hurt, and how to bring it back.

A dockerd restart stops every running container. The test that needs it may stop containers made by
AgentENV test sessions that are over (leftovers of killed or failed runs, common on CI machines), but
nothing else: not a container some other program runs, not one a live test session still uses.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from agentenv.backend import docker_client
from agentenv.backend.base import LABEL_HOME

# Held (flock) by a live test session's $AGENTENV_HOME fixture for the whole session.
SESSION_LOCK = ".pytest-session.lock"
# The agentenv_scale tests label their containers with this key instead of a home.
TEST_LABEL = "org.k3rl.test"
# A test home without a session lock (another suite's fixture) counts as live while its registry changed
# this recently; a home-less test container, while it is this young.
STALE_AFTER_S = 600.0


def hold_session_lock(home: Path) -> int:
    """Mark `home` as used by this live test session until the returned fd is closed (or we die)."""
    fd = os.open(home / SESSION_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _session_is_live(home: Path, now: float) -> bool:
    lock = home / SESSION_LOCK
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also drops our probe lock
        return False
    registry = home / "registry.sqlite3"
    changed = max((p.stat().st_mtime for p in (registry, Path(f"{registry}-wal")) if p.exists()),
                  default=None)
    return changed is not None and now - changed < STALE_AFTER_S


def _is_test_home(home: Path) -> bool:
    return any(part.startswith("pytest-of-") for part in home.parts)


def restart_blockers(running: Iterable[Mapping], own_home: Path, now: float | None = None) -> list[str]:
    """Short ids of the running containers (docker API `containers()` rows) that a dockerd restart must
    not stop: all except this session's own and those of AgentENV test sessions that are over."""
    now = time.time() if now is None else now
    blockers = []
    for c in running:
        labels = c.get("Labels") or {}
        home = labels.get(LABEL_HOME)
        if home is not None and Path(home) == own_home.resolve():
            continue
        if home is not None and _is_test_home(Path(home)) and not _session_is_live(Path(home), now):
            continue
        if home is None and TEST_LABEL in labels and now - float(c.get("Created", now)) >= STALE_AFTER_S:
            continue
        blockers.append(c["Id"][:12])
    return blockers


def dockerd_pid() -> int:
    """The dockerd serving $DOCKER_HOST (the default socket when unset)."""
    sock = docker_client.daemon_url().removeprefix("unix://")
    candidates = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout.split()
    for pid in map(int, candidates):
        if not _running(pid):  # a stopped daemon not reaped yet (pgrep lists zombies)
            continue
        args = _cmdline(pid)
        hosts = [a.removeprefix("unix://") for i, a in enumerate(args)
                 if i and args[i - 1] in ("-H", "--host")]
        hosts += [a.split("=", 1)[1].removeprefix("unix://") for a in args if a.startswith("--host=")]
        if sock in hosts or (not hosts and sock == "/var/run/docker.sock"):
            return pid
    raise AssertionError(f"no dockerd process serves {sock}")


def _cmdline(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def _running(pid: int) -> bool:
    """Whether process `pid` still runs. A daemon an earlier restart in this process started is our child:
    once it exits it stays a zombie (its /proc entry included) until reaped, so reap it here."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: init reaps it
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def restart_dockerd(pid: int, ensure_script: Path) -> list[str]:
    """Stop the daemon and start it again exactly as it was (binary, arguments such as --experimental,
    environment, working dir); wait until it answers. Returns the command line it was started with.
    The daemon is brought back even when stopping it fails half-way."""
    cmdline, exe = _cmdline(pid), os.readlink(f"/proc/{pid}/exe")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    if not os.path.isdir(cwd):  # started from a folder deleted since (e.g. an earlier CI clone)
        cwd = "/"
    env = dict(kv.split("=", 1) for kv in
               Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in kv)
    log_dir = Path(os.environ.get("K3RL_LOG_DIR", "/var/log/k3rl"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.kill(pid, 15)
        for sig, wait_s in ((15, 60.0), (9, 15.0)):  # SIGKILL only for a daemon that ignores SIGTERM
            if sig == 9 and _running(pid):
                os.kill(pid, 9)
            deadline = time.monotonic() + wait_s
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert not _running(pid), "dockerd did not stop within 75 s, even killed"
    finally:
        with open(log_dir / "dockerd.log", "ab") as log:
            try:
                subprocess.Popen(cmdline, executable=exe, cwd=cwd, env=env, stdout=log, stderr=log,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:  # fall back to the project's own `dockerd --experimental` at once
                log.write(f"restart_dockerd: could not start {cmdline}: {exc}\n".encode())
                log.flush()
                subprocess.run(["bash", str(ensure_script)], check=True, timeout=120)
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:  # last resort: the project's own `dockerd --experimental`
                subprocess.run(["bash", str(ensure_script)], check=True, timeout=120)
                break
            time.sleep(0.3)
        docker_client.reset()
    return cmdline
