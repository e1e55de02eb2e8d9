"""The local runtime: the registry and the backend of the current `$AGENTENV_HOME`, one pair per home per
process, and the removal of a sandbox from both.

`runtime()` is where the backend is selected (`agentenv.backend.selection`); everything outside
`agentenv.backend` reaches containers through the `SandboxBackend` it holds, never through Docker itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.base import ContainerRef, SandboxBackend
from agentenv.backend.selection import select_backend
from agentenv.paths import agentenv_home
from agentenv.registry import Registry, SandboxRecord

__all__ = ["Runtime", "remove_sandbox", "runtime"]


@dataclass
class Runtime:
    home: Path
    registry: Registry
    backend: SandboxBackend


_runtimes: dict[Path, Runtime] = {}
_runtimes_lock = threading.Lock()


def runtime() -> Runtime:
    """Registry + backend for the current `$AGENTENV_HOME` (one per home per process)."""
    home = agentenv_home().resolve()
    with _runtimes_lock:
        rt = _runtimes.get(home)
        if rt is None:
            rt = _runtimes[home] = Runtime(home, Registry(home), select_backend(home))
        return rt


def remove_sandbox(rt: Runtime, rec: SandboxRecord, reason: str | None = None) -> None:
    """Remove a sandbox's container, volume and checkpoints and mark its row closed (with `reason` when
    given). The caller holds the sandbox's lock: `Sandbox.close`, and gc for an orphan."""
    rt.backend.remove(ContainerRef(container=rec.container or "", volume=rec.volume or ""))
    while (ck := rt.registry.latest_checkpoint(rec.id)) is not None:
        rt.registry.delete_checkpoint(ck.id)
    rt.registry.update_sandbox(rec.id, state="closed", **({} if reason is None else {"reason": reason}))
