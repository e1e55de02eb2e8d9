"""The host's CPU, measured: what a pause or a resume cost in CPU seconds, and how many cores are spare.

A CRIU dump or restore runs in dockerd, containerd, its shims, runc and CRIU, not in the caller's process.
Where those daemons sit in a cgroup of their own (a systemd service, or the `k3rl-runtime` cgroup
scripts/ensure_dockerd.sh moves a daemon it finds in the root cgroup to), their CPU is read there
exactly: the cgroup's CPU counter (cpuacct on cgroup v1, cpu.stat on v2) covers the daemons and every
process they start (shims, runc, CRIU and its helpers), and not the sandboxes' workloads (their
containers have cgroups elsewhere), the learner or the policy. Where they share the root cgroup with
everything else, the only counter left is the host's busy time in /proc/stat (every core, every process,
the kernel included). Readers:

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
* `SpareCores` is the host's idle cores (cores × idle fraction) over the last `window_s` seconds, from
  readings it keeps: what a batch of pauses could use without taking CPU from the learner or the
  policy. A container's CPU quota (cgroup v2 ``cpu.max`` of this process) caps it when one is set.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.cgroups import CGROUP_ROOT, cgroup_dirs
from agentenv.backend.procs import pids_named

PROC_STAT = Path("/proc/stat")


def host_cpu_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot (/proc/stat's first line; idle and iowait
    are the not-busy part)."""
    fields = [int(x) for x in PROC_STAT.read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    busy = (user + nice + system + irq + softirq + steal) / tick
    return busy, busy + (idle + iowait) / tick


def host_cpu_seconds() -> float:
    """CPU seconds the whole host has spent busy since boot (see `host_cpu_times`)."""
    return host_cpu_times()[0]


def cpu_quota_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Cores this process may use by its cgroup v2 ``cpu.max`` quota; None when there is none (``max``,
    cgroup v1, or no such file)."""
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        quota, period = (cgroup_root / rel.lstrip("/") / "cpu.max").read_text().split()[:2]
    except (OSError, StopIteration, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


class SpareCores:
    """Idle cores of the host over the last `window_s` seconds (see the module docstring).

    Every call reads /proc/stat and keeps the reading; the answer is the idle share between the oldest
    reading inside the window and now. The first call (no earlier reading at least `min_span_s` old)
    waits `min_span_s` for a second one."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 0.2) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.cores = os.cpu_count() or 1
        self.quota = cpu_quota_cores()
        self._readings: deque[tuple[float, float, float]] = deque()  # (monotonic t, busy s, total s)
        self._lock = threading.Lock()
        self._read()

    def _read(self) -> tuple[float, float, float]:
        busy, total = host_cpu_times()
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
        spare = max(0.0, idle_share) * self.cores
        return spare if self.quota is None else min(spare, self.quota)


RUNTIME_DAEMONS = ("dockerd", "containerd")  # their cgroups hold the runtime's CPU (see the docstring)
HOST = "host"  # `CpuReading.source` when the runtime has no cgroup of its own


@dataclass(frozen=True)
class CpuReading:
    """A cumulative CPU counter in seconds and where it was read: `HOST` or the runtime's cgroup folders
    (readings of different sources cannot be subtracted)."""

    seconds: float
    source: str


def runtime_cgroups(pids: list[int] | None = None, root: Path = CGROUP_ROOT) -> list[Path]:
    """The CPU-accounting cgroup folders (cpuacct on v1, unified on v2) of the runtime's daemons
    (`RUNTIME_DAEMONS`, or ``pids``), outermost only; [] when none runs or any of them is in the root
    cgroup (its CPU cannot be told from the host's there)."""
    found: set[Path] = set()
    for pid in pids_named(*RUNTIME_DAEMONS) if pids is None else pids:
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
