"""Kernel samepage merging for forks: the runtime owns ksmd's settings while forks share pages.

Forks restored from one checkpoint start with identical memory, but CRIU copies every page into each
child's private memory. Their restores run with PR_SET_MEMORY_MERGE (`nsexec.start_criu`), which makes
all their anonymous memory mergeable, and ksmd then folds identical pages into one copy-on-write page.
ksmd only scans processes that asked for it, so its CPU goes to forks alone; `pages_to_scan` pages every
`sleep_millisecs` bound that CPU (conf/agentenv/backend.yaml). The counters are host-wide (`describe`,
`counters`), and so is ksmd's CPU time (`ksmd_cpu_seconds`: what the benchmarks charge merging).
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
KSM = Path("/sys/kernel/mm/ksm")
COUNTERS = ("pages_shared", "pages_sharing", "pages_unshared", "full_scans", "general_profit")
_ksmd_pid = 0  # found once per process (a kernel thread keeps its pid until the next boot)


def _write(name: str, value: int) -> None:
    path = KSM / name
    if path.read_text().strip() != str(value):
        path.write_text(str(value))


def ensure_running(settings) -> bool:
    """Start ksmd with the configured scan rate; False (logged once per reason) where the host does not
    allow it (no KSM in the kernel, or /sys read-only)."""
    try:
        _write("pages_to_scan", settings.ksm_pages_to_scan)
        _write("sleep_millisecs", settings.ksm_sleep_ms)
        _write("run", 1)
        return True
    except OSError as e:
        log.warning("KSM unavailable (%s): forks keep private copies of their pages", e)
        return False


def describe() -> dict[str, object]:
    """ksmd's state and counters (host-wide), or why there are none."""
    try:
        out: dict[str, object] = {"run": int((KSM / "run").read_text())}
        for name in ("pages_to_scan", "sleep_millisecs", *COUNTERS):
            if (KSM / name).exists():
                out[name] = int((KSM / name).read_text())
        return out
    except (OSError, ValueError) as e:
        return {"unavailable": str(e)}


def counters() -> dict[str, int]:
    """The host-wide counters of `COUNTERS` this kernel has (empty without KSM)."""
    out: dict[str, int] = {}
    for name in COUNTERS:
        try:
            out[name] = int((KSM / name).read_text())
        except (OSError, ValueError):
            continue
    return out


def stat_cpu_seconds(stat: str) -> float:
    """utime + stime of a /proc/<pid>/stat line, in seconds (the name may hold spaces and parentheses)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ksmd_cpu_seconds() -> float | None:
    """CPU seconds ksmd has run since boot; None where the kernel has no ksmd. ksmd is a kernel thread
    (a child of kthreadd, pid 2), so no cgroup charges it: its /proc/<pid>/stat does."""
    global _ksmd_pid
    known = [_ksmd_pid] if _ksmd_pid else []
    for pid in itertools.chain(known, (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if stat[stat.index("(") + 1:stat.rindex(")")] == "ksmd" and fields[1] == "2":
            _ksmd_pid = pid
            return stat_cpu_seconds(stat)
    return None
