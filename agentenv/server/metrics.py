"""`GET /sandboxes/{id}/metrics` (the SDK's `get_metrics`): one sample of a sandbox's resource use, read
when asked from its cgroup and its work dir (`SandboxBackend.usage` and `sample`).

Unlike E2B this server keeps no time series: a call returns the sample taken now when now lies in the
asked range; a paused sandbox shows zeros.

Design: docs/design/sandboxes.md#agentenv-server-metrics.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from agentenv.backend.base import ContainerRef
from agentenv.runtime import runtime
from agentenv.sandbox import Sandbox


@dataclass(frozen=True)
class Sample:
    when: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int

    def to_json(self) -> dict:
        stamp = datetime.fromtimestamp(self.when, UTC).isoformat().replace("+00:00", "Z")
        return {"timestamp": stamp, "timestampUnix": int(self.when), "cpuCount": self.cpu_count,
                "cpuUsedPct": round(self.cpu_used_pct, 2), "memUsed": self.mem_used,
                "memTotal": self.mem_total, "memCache": self.mem_cache, "diskUsed": self.disk_used,
                "diskTotal": self.disk_total}


class Metrics:
    """Samples sandboxes; remembers each one's last CPU reading to give the use between two calls."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def sample(self, sb: Sandbox, started_at: float) -> Sample:
        now = time.time()
        st = sb.stats()
        cfg = sb.config
        cache = disk_used = disk_total = 0
        if st.state == "running" and sb.container_id:
            held = runtime().backend.sample(ContainerRef(sb.container_id, ""), cfg.workspace)
            cache, disk_used, disk_total = held.page_cache_bytes, held.disk_used_bytes, held.disk_total_bytes
        with self._lock:
            then, cpu_then = self._last.get(sb.id, (started_at, 0.0))
            self._last[sb.id] = (now, st.cpu_seconds)
        cpus = max(cfg.cpus, 0.01)
        pct = 0.0 if now <= then else max(0.0, (st.cpu_seconds - cpu_then) / (now - then) / cpus * 100)
        return Sample(when=now, cpu_count=max(1, math.ceil(cfg.cpus)), cpu_used_pct=min(pct, 100.0),
                      mem_used=st.rss_bytes, mem_total=cfg.memory_bytes, mem_cache=cache,
                      disk_used=disk_used, disk_total=disk_total)

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._last.pop(sandbox_id, None)
