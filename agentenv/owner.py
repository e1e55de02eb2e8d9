"""Which process owns a sandbox, so that the sandboxes of a process that died can be found and closed.

`owner_labels` tie a sandbox to a process's lifetime (boot id, pid, start time); `keeper_labels` tie it to a
path instead (a checkpoint keeping in-flight episodes). `agentenv gc` closes sandboxes whose owner or path
is gone; unlabelled sandboxes are never closed this way.

Design: docs/design/sandboxes.md#agentenv-owner.
"""

from __future__ import annotations

import os
from pathlib import Path

OWNER_LABEL = "org.k3rl.agentenv.owner"
KEEPER_LABEL = "org.k3rl.agentenv.kept-by"


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after "(comm)" (its field 3 is the first); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return stat.rsplit(")", 1)[1].split()


def start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if gone."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]


def still_running(pid: int, ticks: str) -> bool:
    """Whether process `pid`, started at `ticks` (`start_ticks`; not a later one of the same pid), has not
    exited yet (a zombie has: it only waits to be reaped)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[19] == ticks and fields[0] not in ("Z", "X")


def owner_labels(pid: int | None = None) -> dict[str, str]:
    """The label naming this process (or `pid`) as the owner of the sandboxes it makes."""
    pid = os.getpid() if pid is None else pid
    ticks = start_ticks(pid)
    if ticks is None:
        raise ProcessLookupError(f"no process {pid}")
    return {OWNER_LABEL: f"{_boot_id()}:{pid}:{ticks}"}


def owner_alive(value: str) -> bool:
    """Whether the process an `OWNER_LABEL` value names still runs (a malformed value counts as alive:
    never close what cannot be judged)."""
    try:
        boot, pid, ticks = value.split(":")
        pid_number = int(pid)
    except ValueError:
        return True
    if boot != _boot_id():
        return False  # the machine rebooted since: the owner is gone
    return start_ticks(pid_number) == ticks


def keeper_labels(path: str | os.PathLike) -> dict[str, str]:
    """The label that keeps a sandbox for as long as `path` (made absolute) exists."""
    return {KEEPER_LABEL: str(Path(path).resolve())}


def keeper_alive(value: str) -> bool:
    """Whether the path a `KEEPER_LABEL` value names still exists (a relative value counts as alive)."""
    path = Path(value)
    return not path.is_absolute() or path.exists()
