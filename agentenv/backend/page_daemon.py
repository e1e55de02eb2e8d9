"""CRIU's page daemon for lazy restores: `criu lazy-pages` serves a restored tree's memory through
userfaultfd, each page on its first touch and the rest in the background, so the processes run before
their memory has been read. One daemon serves one restore and exits once every page is in; a daemon can
be started ahead of the restore (`PageDaemon.start` returns before it listens) to take its start-up off
a resume's critical path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from agentenv.backend.nsexec import criu_program
from agentenv.errors import CheckpointError
from agentenv.owner import start_ticks, still_running

SOCKET = "lazy-pages.socket"
LOG = "lazy-pages.log"


_ACCEPTING = 1 << 16  # __SO_ACCEPTCON in /proc/net/unix's Flags: the socket listens


def listening(pid: int) -> bool:
    """Whether process `pid` holds a unix socket that listens (read from /proc: a probe connection would
    be taken by the daemon for a restore's)."""
    held = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    held.add(target[8:-1])
        table = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        return False
    for line in table:
        fields = line.split()
        if len(fields) >= 7 and fields[6] in held and int(fields[3], 16) & _ACCEPTING:
            return True
    return False


class PageDaemon:
    """`criu lazy-pages` for the images in `images` (its socket and log in `work`)."""

    def __init__(self, images: Path, work: Path, kdat: Path | None = None) -> None:
        self.images, self.work = Path(images), Path(work)
        self.kdat = kdat  # CRIU's kernel-facts cache: read from /run, which the daemon gets in a namespace
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.finished: float | None = None  # when every page was in (the daemon exited 0)
        self._reaper: threading.Thread | None = None

    def start(self) -> PageDaemon:
        (self.work / SOCKET).unlink(missing_ok=True)
        prog = criu_program()
        argv = [prog.loader, "--library-path", ":".join(prog.library_path), prog.binary, "lazy-pages",
                "-D", str(self.images), "-W", str(self.work), "-o", LOG]
        if self.kdat is not None:  # /run here is not a tmpfs: CRIU would recompute the facts (20-30 ms)
            argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                    'mount --bind "$1" /run && shift && exec "$@"', "sh", str(self.kdat.parent), *argv]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_listening(self, timeout_s: float) -> None:
        """Return once the daemon accepts the restore's connection; CheckpointError if it died or took
        longer than `timeout_s`."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        # CRIU binds the socket before it listens: between the two, its file exists but a connect is refused
        while not ((self.work / SOCKET).exists() and listening(self.proc.pid)):
            if self.proc.poll() is not None:
                raise CheckpointError(f"CRIU's page daemon exited with {self.proc.returncode} before it "
                                      f"listened (its log: {self.work / LOG})")
            if time.monotonic() > deadline:
                self.kill()
                raise CheckpointError(f"CRIU's page daemon did not listen within {timeout_s:g} s")
            time.sleep(0.0005)

    def reap_in_background(self, cleanup: Path | None = None) -> None:
        """After a restore that connected: let a thread wait for the last page (and record when), then
        delete the folder `cleanup` (the restore's work dir)."""
        def reap() -> None:
            assert self.proc is not None
            if self.proc.wait() == 0:
                self.finished = time.monotonic()
            if cleanup is not None:
                shutil.rmtree(cleanup, ignore_errors=True)
        self._reaper = threading.Thread(target=reap, name="agentenv-page-daemon", daemon=True)
        self._reaper.start()

    def wait_done(self, timeout_s: float) -> float | None:
        """Seconds from the daemon's start until every page was in, or None (still serving, or failed)."""
        if self._reaper is not None:
            self._reaper.join(timeout_s)
        return None if self.finished is None else self.finished - self.started

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        (self.work / SOCKET).unlink(missing_ok=True)

    def log_path(self) -> Path:
        return self.work / LOG

    def write_marker(self, path: Path) -> None:
        """Name this daemon in `path` ("PID START_TICKS") for other processes to wait for (`wait_marked`)."""
        assert self.proc is not None
        ticks = start_ticks(self.proc.pid)
        if ticks is not None:
            path.write_text(f"{self.proc.pid} {ticks}")


def wait_marked(path: Path, timeout_s: float) -> bool:
    """Wait until the daemon named in `path` (`write_marker`, maybe by another process) has exited: True
    when it has, or none is named; False when it still runs after `timeout_s`."""
    try:
        pid, ticks = path.read_text().split()
    except (OSError, ValueError):
        return True
    deadline = time.monotonic() + timeout_s
    while still_running(int(pid), ticks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
