"""Locks that hold across threads and processes: per sandbox, and host-wide on one file.

A sandbox's lock is `flock` on `$AGENTENV_HOME/locks/<id>.lock`. flock belongs to the open file
description, so two threads of one process conflict just like two processes do, and the kernel drops the
lock when its holder dies (no stale locks after a crash). A thread re-entering a lock it holds passes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from agentenv.errors import SandboxBusy

_HELD = threading.local()


@contextlib.contextmanager
def sandbox_lock(lock_dir: Path, sandbox_id: str, timeout_s: float, action: str = "change") -> Iterator[None]:
    """Hold the sandbox's lock for the `with` body; wait at most `timeout_s` for another holder. A thread
    that holds it already re-enters at once (e.g. `Sandbox.exec` marking a sandbox broken under the lock
    the server holds around a request); with a second flock it would wait for itself until `timeout_s`."""
    key = (str(lock_dir), sandbox_id)
    held = _held_here()
    if key in held:
        yield
        return
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"{sandbox_id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise SandboxBusy(
                        f"sandbox {sandbox_id} is busy: another thread or process has held its lock for "
                        f"{timeout_s:.0f} s, so it could not {action} it; retry later"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _held_here() -> set[tuple[str, str]]:
    """The sandbox locks this thread holds: (lock dir, sandbox id)."""
    held = getattr(_HELD, "locks", None)
    if held is None:
        held = _HELD.locks = set()
    return held


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created, with its folder, if missing) for the `with` body,
    waiting as long as it takes: for short host-wide critical sections (the checkpoint store's cap check,
    Docker's dumps, claiming spare shells)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock
