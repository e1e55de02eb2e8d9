"""The host's CPU, measured: what a pause or a resume cost in CPU seconds, and how many cores are spare.

A CRIU dump or restore runs in dockerd, containerd, runc and CRIU, not in the caller's process, so its
CPU is read where it all shows: the host's busy time in /proc/stat (every core, every process, the
kernel included). Two readers share that one counter:

* `OpCpu` charges the host's busy CPU seconds of each interval to the pool operations (pauses,
  resumes) in flight in it, split evenly among them, so that concurrent pauses from many threads are not
  each charged the whole. Work of other processes running at the same time is charged too: an upper
  bound, which makes the cost model err on the side of not pausing.
* `SpareCores` is the host's idle cores (cores × idle fraction) over the last `window_s` seconds, from
  readings it keeps: what a batch of pauses could use without taking CPU from the learner or the
  policy. A container's CPU quota (cgroup v2 ``cpu.max`` of this process) caps it when one is set.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path

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


class OpCpu:
    """The host's busy CPU seconds charged to operations in flight (see the module docstring): `start()`
    returns a token, `stop(token)` the CPU seconds charged to that operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._charged: dict[int, float] = {}  # token -> CPU seconds so far
        self._last = 0.0
        self._next = 0

    def _settle(self) -> None:
        """Split the busy time since the last event among the operations in flight (lock held)."""
        busy = host_cpu_seconds()
        if self._charged:
            share = (busy - self._last) / len(self._charged)
            for token in self._charged:
                self._charged[token] += share
        self._last = busy

    def start(self) -> int:
        with self._lock:
            self._settle()
            self._next += 1
            self._charged[self._next] = 0.0
            return self._next

    def stop(self, token: int) -> float:
        with self._lock:
            self._settle()
            return self._charged.pop(token, 0.0)


OP_CPU = OpCpu()  # one per process: every pool's operations in it share the host's counter
