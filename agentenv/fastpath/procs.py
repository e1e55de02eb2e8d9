"""The processes of a container and their memory, read from /proc and the container's cgroup.

A checkpoint records the container's process tree (PID inside the container + command line); after a
restore the container's init must be back under its PID and command line. Together with CRIU's restore
log of that very start this is how the fast path checks that a restore really restored (Docker has
reported success for fresh starts before: docker/for-linux #1192).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, order=True)
class ProcessInfo:
    ns_pid: int  # PID inside the container's PID namespace (what CRIU restores)
    cmdline: str


def _cgroup_dir(pid: int, controller: str) -> Path | None:
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return CGROUP_ROOT / controller / path.lstrip("/")
        if hier == "0" and controllers == "":
            unified = CGROUP_ROOT / path.lstrip("/")
    if unified is not None and (unified / "cgroup.procs").exists():
        return unified
    return None


def container_pids(init_pid: int) -> list[int]:
    """Host PIDs of every process in the cgroup of `init_pid` (a container's init)."""
    if init_pid <= 0:
        return []
    d = _cgroup_dir(init_pid, "pids") or _cgroup_dir(init_pid, "memory")
    if d is None:
        return []
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _ns_pid(pid: int) -> int | None:
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
    for pid in container_pids(init_pid):
        ns_pid, cmd = _ns_pid(pid), _cmdline(pid)
        if ns_pid is not None and cmd is not None:
            out.append(ProcessInfo(ns_pid, cmd))
    return tuple(sorted(out))


def memory_bytes(init_pid: int) -> int:
    """Anonymous memory + tmpfs of the container's cgroup: about what a checkpoint must write."""
    d = _cgroup_dir(init_pid, "memory") if init_pid > 0 else None
    if d is None:
        return 0
    stat: dict[str, int] = {}
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            stat[key] = int(value)
    except (OSError, ValueError):
        return 0
    if "total_rss" in stat:  # cgroup v1
        return stat["total_rss"] + stat.get("total_shmem", 0)
    return stat.get("anon", 0) + stat.get("shmem", 0)


def tree_matches(recorded: tuple[ProcessInfo, ...], now: tuple[ProcessInfo, ...]) -> bool:
    """True when the container's init (the lowest recorded PID) came back with its PID and command line.

    Other processes are not compared: between the recording and the dump one may exit or `execve`
    (e.g. `nohup` becoming its command), so their absence or a new command line proves nothing. A
    fresh start is caught by CRIU's restore log of this start (engine.FastPath._verify)."""
    if not recorded:
        return True
    init = recorded[0]
    return any(p.ns_pid == init.ns_pid and p.cmdline == init.cmdline for p in now)
