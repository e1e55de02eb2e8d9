"""Plain result records returned by the Sandbox API (JSON-friendly via `to_dict`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command run in a sandbox.

    `exit_code` is the command's status (124 when the timeout killed it, 128+N when signal N did);
    `stdout`/`stderr` are decoded as UTF-8 (bad bytes replaced) and each capped at the sandbox's
    `output_limit_bytes`; `truncated` says that at least one of them was cut; `oom_killed` that the kernel
    OOM killer killed a process of the sandbox during this command (the sandbox is then marked broken).
    """

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    truncated: bool = False
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SandboxStats:
    """Resource use of a sandbox now. A paused sandbox has no process, so rss_bytes is 0 and pids 0.

    `cpu_seconds` adds up CPU time over the sandbox's whole life (across pause/resume);
    `cpu_seconds_since_start` is the part since its processes were last started or restored (their
    cgroup's own count: right after a resume, mostly CRIU's restore of their memory, which runs in them);
    `checkpoint_bytes` is the size on disk of the checkpoint it currently holds (0 while running).
    """

    id: str
    state: str
    rss_bytes: int
    cpu_seconds: float
    checkpoint_bytes: int
    pids: int
    memory_limit_bytes: int
    user: str
    cpu_seconds_since_start: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
