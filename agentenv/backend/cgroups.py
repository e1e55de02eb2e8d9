"""Read a container's resource use straight from its cgroup files (microseconds, unlike `docker stats`).

Works with cgroup v1 (one hierarchy per controller, as on this machine) and v2 (unified). A container
with no process (paused, stopped) has no cgroup: every reader then returns zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupUsage:
    rss_bytes: int       # anonymous memory + tmpfs/shared memory: what a checkpoint must save
    cpu_seconds: float   # CPU time since the cgroup was created (i.e. since the last start/restore)
    pids: int            # processes and threads now
    oom_kills: int       # processes the OOM killer killed since the cgroup was created


ZERO = CgroupUsage(0, 0.0, 0, 0)


def cgroup_dirs(pid: int) -> dict[str, Path]:
    """{controller: directory} for process `pid`; v2 gives the single key 'unified'."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    dirs: dict[str, Path] = {}
    unified: str | None = None
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            unified = path
            continue
        for ctrl in controllers.split(","):
            if ctrl and not ctrl.startswith("name="):
                dirs[ctrl] = CGROUP_ROOT / ctrl / path.lstrip("/")
    if not dirs and unified is not None:
        dirs["unified"] = CGROUP_ROOT / unified.lstrip("/")
    return dirs


def _kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
    except (FileNotFoundError, ProcessLookupError, OSError):
        pass
    return out


def _int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (FileNotFoundError, ProcessLookupError, OSError, ValueError, IndexError):
        return 0


def read_usage(pid: int) -> CgroupUsage:
    """Usage of the cgroup that process `pid` (a container's init, host pid) belongs to."""
    if pid <= 0:
        return ZERO
    dirs = cgroup_dirs(pid)
    if not dirs:
        return ZERO
    if "unified" in dirs:
        d = dirs["unified"]
        mem = _kv(d / "memory.stat")
        return CgroupUsage(
            rss_bytes=mem.get("anon", 0) + mem.get("shmem", 0),
            cpu_seconds=_kv(d / "cpu.stat").get("usage_usec", 0) / 1e6,
            pids=_int(d / "pids.current"),
            oom_kills=_kv(d / "memory.events").get("oom_kill", 0),
        )
    mem_dir = dirs.get("memory")
    mem = _kv(mem_dir / "memory.stat") if mem_dir else {}
    cpu_dir = dirs.get("cpuacct")
    pids_dir = dirs.get("pids")
    return CgroupUsage(
        rss_bytes=mem.get("total_rss", 0) + mem.get("total_shmem", 0),
        cpu_seconds=_int(cpu_dir / "cpuacct.usage") / 1e9 if cpu_dir else 0.0,
        pids=_int(pids_dir / "pids.current") if pids_dir else 0,
        oom_kills=_kv(mem_dir / "memory.oom_control").get("oom_kill", 0) if mem_dir else 0,
    )


def page_cache_bytes(pid: int) -> int:
    """File pages charged to the memory cgroup of process `pid` (v1 `cache`, v2 `file`); 0 without one."""
    dirs = cgroup_dirs(pid) if pid > 0 else {}
    mem = dirs.get("memory") or dirs.get("unified")
    if mem is None:
        return 0
    stat = _kv(mem / "memory.stat")
    return stat.get("cache", stat.get("file", 0))


def cgroup_pids(pid: int) -> list[int]:
    """Host PIDs of every process in the cgroup of `pid` (a container's init); [] when it has none."""
    if pid <= 0:
        return []
    dirs = cgroup_dirs(pid)
    d = dirs.get("pids") or dirs.get("memory") or dirs.get("unified")
    if d is None:
        return []
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return []
