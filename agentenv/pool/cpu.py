"""The host's CPU, measured: what a pause or a resume cost in CPU seconds, and how many cores are spare.

A CRIU dump or restore runs in dockerd, containerd, its shims, runc and CRIU, not in the caller's process
(the backend names its daemons: `SandboxBackend.daemon_pids`). Where those daemons sit in a cgroup of
their own (a systemd service, or the `k3rl-runtime` cgroup scripts/ensure_dockerd.sh moves a daemon it
finds in the root cgroup to), their CPU is read there exactly: the cgroup's CPU counter (cpuacct on
cgroup v1, cpu.stat on v2) covers the daemons and every process they start (shims, runc, CRIU and its
helpers), and not the sandboxes' workloads (their containers have cgroups elsewhere), the learner or the
policy. Where they share the root cgroup with everything else, the only counter left is the host's busy
time in /proc/stat (every core, every process, the kernel included). Readers:

* `RuntimeCpu` is that counter: the runtime's cgroups when it has them, else the host's busy time; each
  reading says which it is (`source`).
* `OpCpu` charges the counter's CPU seconds of each interval to the pool operations (pauses, resumes) in
  flight in it, split evenly among them, so that concurrent pauses from many threads are not each
  charged the whole; with the runtime's cgroups it adds the calling thread's own CPU time, this
  process's waited-for children (the `ctr` client of a dump) and, for a restore, the restored
  sandbox's cgroup CPU since the restore (CRIU copies the memory back inside the restored processes).
  Not counted then: the dumped processes' own share (CRIU's parasite code copying their pages out runs
  in the sandbox, whose cgroup the dump ends) and kernel threads writing the images back. Other
  runtime work at the same time (another sandbox's `docker exec`) is charged too; with the host's
  counter, every process's work is: an upper bound, which makes the cost model err on the side of not
  pausing.
* `SpareCores` is the idle cores over the last `window_s` seconds, from readings it keeps: what a batch
  of pauses could use without taking CPU from the learner or the policy. It counts only the CPUs this
  process may run on (its affinity: `taskset`, a cpuset) and is capped by the CPU quotas on its cgroup
  path (`cpu_quota_cores`: v1 ``cpu.cfs_quota_us``, v2 ``cpu.max``, its own cgroup and every ancestor):
  at most `effective_cores()`.
"""

from __future__ import annotations

import os
import posixpath
import resource
import threading
import time
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.cgroups import CGROUP_ROOT, cgroup_dirs

PROC_STAT = Path("/proc/stat")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_SELF_MOUNTINFO = Path("/proc/self/mountinfo")


def host_cpu_times(cpus: Collection[int] | None = None) -> tuple[float, float]:
    """(busy, total) CPU seconds since boot of the whole host (/proc/stat's first line) or, given
    ``cpus``, of those CPUs together (their ``cpuN`` lines); idle and iowait are the not-busy part."""
    lines = PROC_STAT.read_text().splitlines()
    if cpus is None:
        rows = [lines[0]]
    else:
        wanted = {f"cpu{n}" for n in cpus}
        rows = [line for line in lines if line.split(" ", 1)[0] in wanted]
    tick = os.sysconf("SC_CLK_TCK")
    busy = idle = 0
    for row in rows:
        user, nice, system, idle_t, iowait, irq, softirq, steal = (int(x) for x in row.split()[1:9])
        busy += user + nice + system + irq + softirq + steal
        idle += idle_t + iowait
    return busy / tick, (busy + idle) / tick


def host_cpu_seconds() -> float:
    """CPU seconds the whole host has spent busy since boot (see `host_cpu_times`)."""
    return host_cpu_times()[0]


@dataclass(frozen=True)
class CgroupMount:
    """One mounted cgroup hierarchy (a line of /proc/self/mountinfo): v1 with its controllers, or v2."""

    root: str  # the part of the hierarchy mounted here ("/" unless a cgroup namespace or a bind mount)
    mount_point: Path
    version: int  # 1 or 2
    options: frozenset[str]  # the super options: a v1 hierarchy's controllers are among them


def cgroup_mounts(mountinfo: Path = PROC_SELF_MOUNTINFO) -> list[CgroupMount]:
    """The cgroup hierarchies mounted in this process's mount namespace."""
    mounts = []
    for line in mountinfo.read_text().splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        root, point = (f.replace("\\040", " ") for f in fields[3:5])
        mounts.append(CgroupMount(root, Path(point), 2 if tail[0] == "cgroup2" else 1,
                                  frozenset(tail[2].split(","))))
    return mounts


def _cgroup_chain(mount: CgroupMount, path: str) -> Iterator[Path]:
    """The folders of cgroup ``path`` (as /proc/PID/cgroup names it) and of each ancestor visible under
    ``mount``, innermost first; none when the path lies outside the mounted part of the hierarchy."""
    rel = posixpath.relpath(path, mount.root)
    if rel == ".." or rel.startswith("../"):
        return
    folder = mount.mount_point / ("" if rel == "." else rel)
    while True:
        yield folder
        if folder == mount.mount_point:
            return
        folder = folder.parent


def _quota(folder: Path, version: int) -> float | None:
    """Cores one cgroup folder's CPU quota allows; None when it sets none (or cannot be read)."""
    try:
        if version == 1:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        else:
            max_quota, max_period = (folder / "cpu.max").read_text().split()[:2]
            if max_quota == "max":
                return None
            quota, period = int(max_quota), int(max_period)
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_quota_cores(proc_cgroup: Path = PROC_SELF_CGROUP,
                    mountinfo: Path = PROC_SELF_MOUNTINFO) -> float | None:
    """The fewest cores any CPU quota on this process's cgroup path allows: cgroup v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in the hierarchy holding the ``cpu`` controller and v2
    ``cpu.max``, each at the process's own cgroup and every ancestor up to the mount (a parent's quota
    binds its children); the folders come from /proc/self/cgroup and /proc/self/mountinfo. None when no
    quota is set anywhere."""
    try:
        memberships = [line.split(":", 2) for line in proc_cgroup.read_text().splitlines()
                       if line.count(":") >= 2]
        mounts = cgroup_mounts(mountinfo)
    except OSError:
        return None
    quotas = []
    for hierarchy, controllers, path in memberships:
        if hierarchy == "0" and controllers == "":
            candidates = [m for m in mounts if m.version == 2]
        elif "cpu" in controllers.split(","):
            candidates = [m for m in mounts if m.version == 1 and "cpu" in m.options]
        else:
            continue
        for mount in candidates:
            chain = list(_cgroup_chain(mount, path))
            if chain:
                quotas += [q for q in (_quota(f, mount.version) for f in chain) if q is not None]
                break
    return min(quotas, default=None)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: `taskset`, a cpuset), in order."""
    return sorted(os.sched_getaffinity(0))


def effective_cores(cpus: Collection[int] | None = None, quota: float | None = None) -> float:
    """The cores this process can use at once: its affinity's CPU count (``cpus``, default
    `usable_cpus()`), capped by its CPU quota (``quota``, default `cpu_quota_cores()`)."""
    count = float(len(usable_cpus() if cpus is None else cpus))
    quota = cpu_quota_cores() if quota is None else quota
    return count if quota is None else min(count, quota)


class SpareCores:
    """Idle cores this process could use over the last `window_s` seconds (see the module docstring).

    Every call reads /proc/stat's lines of the CPUs of this process's affinity (`cpus`) and keeps the
    reading; the answer is their idle share between the oldest reading inside the window and now, times
    their count, capped by `cores` (`effective_cores`: the quota may allow fewer than the CPUs). The
    first call (no earlier reading at least `min_span_s` old) waits `min_span_s` for a second one."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 0.2) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.cpus = usable_cpus()
        self.quota = cpu_quota_cores()
        self.cores = effective_cores(self.cpus, self.quota)
        self._readings: deque[tuple[float, float, float]] = deque()  # (monotonic t, busy s, total s)
        self._lock = threading.Lock()
        self._read()

    def _read(self) -> tuple[float, float, float]:
        busy, total = host_cpu_times(self.cpus)
        reading = (time.monotonic(), busy, total)
        self._readings.append(reading)
        return reading

    def __call__(self) -> float:
        with self._lock:
            if time.monotonic() - self._readings[-1][0] < self.min_span_s and len(self._readings) < 2:
                time.sleep(self.min_span_s)
            now, busy, total = self._read()
            while len(self._readings) > 2 and now - self._readings[1][0] >= self.window_s:
                self._readings.popleft()  # keep one reading at or beyond the window's start
            _t0, busy0, total0 = self._readings[0]
        if total <= total0:
            return 0.0
        idle_share = 1.0 - (busy - busy0) / (total - total0)
        return min(max(0.0, idle_share) * len(self.cpus), self.cores)


HOST = "host"  # `CpuReading.source` when the runtime has no cgroup of its own


@dataclass(frozen=True)
class CpuReading:
    """A cumulative CPU counter in seconds and where it was read: `HOST` or the runtime's cgroup folders
    (readings of different sources cannot be subtracted)."""

    seconds: float
    source: str


def daemon_pids() -> list[int]:
    """Host PIDs of the daemons of this process's backend (`SandboxBackend.daemon_pids`: dockerd and
    containerd for the container backends)."""
    from agentenv.runtime import runtime

    return runtime().backend.daemon_pids()


def runtime_cgroups(pids: list[int] | None = None, root: Path = CGROUP_ROOT) -> list[Path]:
    """The CPU-accounting cgroup folders (cpuacct on v1, unified on v2) of the runtime's daemons
    (`daemon_pids`, or ``pids``), outermost only; [] when none runs or any of them is in the root
    cgroup (its CPU cannot be told from the host's there)."""
    found: set[Path] = set()
    for pid in daemon_pids() if pids is None else pids:
        dirs = cgroup_dirs(pid)
        folder = dirs.get("cpuacct") or dirs.get("unified")
        if folder is None:
            continue
        if folder in (root, root / "cpuacct"):
            return []
        found.add(folder)
    return sorted(f for f in found if not any(other in f.parents for other in found))


def cgroup_cpu_seconds(folder: Path) -> float:
    """CPU seconds of a cgroup and its descendants since it was made (v1 ``cpuacct.usage``, v2
    ``cpu.stat`` usage_usec); raises OSError when it is gone."""
    usage = folder / "cpuacct.usage"
    if usage.exists():
        return int(usage.read_text().split()[0]) / 1e9
    for line in (folder / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise OSError(f"{folder}: no CPU usage counter")


class RuntimeCpu:
    """The runtime's cumulative CPU seconds, from its cgroups when it has them, else the host's busy time
    (see the module docstring). The daemons' cgroups are looked up again every `refresh_s` seconds (a
    restarted daemon may sit elsewhere)."""

    def __init__(self, refresh_s: float = 10.0) -> None:
        self.refresh_s = refresh_s
        self._folders: list[Path] = []
        self._found_at = -float("inf")

    def __call__(self) -> CpuReading:
        if time.monotonic() - self._found_at >= self.refresh_s:
            self._folders, self._found_at = runtime_cgroups(), time.monotonic()
        if self._folders:
            try:
                return CpuReading(sum(cgroup_cpu_seconds(f) for f in self._folders),
                                  ",".join(str(f) for f in self._folders))
            except (OSError, ValueError):
                self._found_at = -float("inf")  # a daemon moved or its cgroup went: look again next time
        return CpuReading(host_cpu_seconds(), HOST)


def children_cpu_seconds() -> float:
    """CPU seconds of this process's children that it has waited for (the `ctr` client of a dump)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class OpCpu:
    """CPU seconds charged to operations in flight (see the module docstring): `start()` returns a token,
    `stop(token)` the CPU seconds charged to that operation; both are called from the thread that runs
    it."""

    def __init__(self, counter: RuntimeCpu | None = None) -> None:
        self.counter = counter or RuntimeCpu()
        self._lock = threading.Lock()
        self._charged: dict[int, float] = {}  # token -> shared CPU seconds so far
        self._own: dict[int, float] = {}  # token -> the calling thread's CPU time at its start
        self._last: CpuReading | None = None
        self._next = 0

    def _settle(self) -> CpuReading:
        """Split the counter's CPU since the last event among the operations in flight (lock held); an
        interval whose readings come from different sources is charged nothing."""
        reading = self.counter()
        shared = reading.seconds + (children_cpu_seconds() if reading.source != HOST else 0.0)
        last = self._last
        if self._charged and last is not None and last.source == reading.source:
            share = max(0.0, shared - last.seconds) / len(self._charged)
            for token in self._charged:
                self._charged[token] += share
        self._last = CpuReading(shared, reading.source)
        return reading

    def start(self) -> int:
        with self._lock:
            self._settle()
            self._next += 1
            self._charged[self._next] = 0.0
            self._own[self._next] = time.thread_time()
            return self._next

    def stop(self, token: int, restored_cpu_s: float = 0.0) -> float:
        """The CPU seconds of operation ``token``. A restore passes ``restored_cpu_s``, the restored
        sandbox's own cgroup CPU since the restore: CRIU copies the memory back inside the restored
        processes, in their cgroup, which the runtime's cgroup does not hold (the host's counter does)."""
        with self._lock:
            reading = self._settle()
            own = time.thread_time() - self._own.pop(token, time.thread_time())
            # the host's counter already holds this thread's and the restored processes' time
            extra = own + restored_cpu_s if reading.source != HOST else 0.0
            return self._charged.pop(token, 0.0) + extra

    @property
    def source(self) -> str:
        """Where the last reading came from: `HOST` or the runtime's cgroup folders."""
        return self._last.source if self._last else self.counter().source


OP_CPU = OpCpu()  # one per process: every pool's operations in it share the counter
