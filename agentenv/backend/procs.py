"""The processes of a container, read from /proc and the container's cgroup (and the host's daemons by
name: `pids_named`).

A checkpoint records the container's process tree (PID inside the container + command line); after a
restore the container's init must be back under its PID and command line. Together with CRIU's restore
log of that very start and the restore marker this is how a restore is known to have really restored
(Docker has reported success for fresh starts before: docker/for-linux #1192).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.cgroups import cgroup_pids


def host_argvs(proc: Path = Path("/proc")) -> Iterator[list[bytes]]:
    """The command line (argv, as bytes) of every process on this host that is still there to read."""
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                yield (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue


def pids_named(*names: str, proc: Path = Path("/proc")) -> list[int]:
    """Host PIDs of every process whose name (``comm``) is one of `names`."""
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in names:
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return pids


@dataclass(frozen=True, order=True)
class ProcessInfo:
    ns_pid: int  # PID inside the container's PID namespace (what CRIU restores)
    cmdline: str


def ns_pid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def process_tree(init_pid: int) -> tuple[ProcessInfo, ...]:
    """The container's processes, sorted by their PID inside the container."""
    out = []
    for pid in cgroup_pids(init_pid):
        ns, cmd = ns_pid(pid), _cmdline(pid)
        if ns is not None and cmd is not None:
            out.append(ProcessInfo(ns, cmd))
    return tuple(sorted(out))


def tree_matches(recorded: tuple[ProcessInfo, ...], now: tuple[ProcessInfo, ...]) -> bool:
    """True when the container's init (the lowest recorded PID) came back with its PID and command line.

    Other processes are not compared: between the recording and the dump one may exit or `execve`
    (e.g. `nohup` becoming its command), so their absence or a new command line proves nothing. A
    fresh start is caught by CRIU's restore log of this start and by the restore marker."""
    if not recorded:
        return True
    init = recorded[0]
    return any(p.ns_pid == init.ns_pid and p.cmdline == init.cmdline for p in now)
