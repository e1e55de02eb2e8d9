"""`files.watch_dir`: envd's watcher calls (CreateWatcher, GetWatcherEvents, RemoveWatcher: the sync
SDK polls them) and the WatchDir stream (the async SDK), on host-side inotify watchers (`inotify.py`).

Watching on the host needs no process inside the sandbox; watchers per sandbox and their directories are
bounded, so one sandbox cannot use up the host's inotify watches.

Design: docs/design/sandboxes.md#agentenv-server-watch.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import threading
from dataclasses import dataclass

from agentenv.backend.base import ContainerRef
from agentenv.errors import AgentEnvError, InvalidArgument, NotADirectoryInSandbox, SandboxStateError
from agentenv.runtime import runtime
from agentenv.sandbox import Sandbox
from agentenv.server import fsops
from agentenv.server.inotify import DirBudget, Event, Watcher

MAX_PER_SANDBOX = 64
MAX_DIRS_PER_SANDBOX = 4096


@dataclass
class Watch:
    id: str
    sandbox_id: str
    path: str            # the watched directory as the client named it (absolute)
    watcher: Watcher
    include_entry: bool


def _volume_dir(sb: Sandbox) -> str:
    """The host directory of the sandbox's work dir (its volume's mount source)."""
    if sb.status != "running" or not sb.container_id:
        raise SandboxStateError(f"sandbox {sb.id} is {sb.status}; connect to it (resume) first")
    host = runtime().backend.workdir_on_host(ContainerRef(sb.container_id, ""), sb.config.workspace)
    if host is None:
        raise SandboxStateError(f"sandbox {sb.id} has no work-dir volume to watch")
    return str(host)


class Watches:
    """The server's watchers, by id."""

    def __init__(self) -> None:
        self._watches: dict[str, Watch] = {}
        self._claimed: dict[str, int] = {}        # sandbox id -> watchers it has or is creating
        self._budgets: dict[str, DirBudget] = {}  # sandbox id -> the directories its watchers may watch
        self._lock = threading.Lock()

    def create(self, sb: Sandbox, path: str, recursive: bool, include_entry: bool) -> Watch:
        """Watch directory `path` of `sb` (FileNotFoundInSandbox when it is not there,
        NotADirectoryInSandbox when it is no directory)."""
        full = fsops.sandbox_path(sb, path)
        entry = fsops.stat(sb, full)
        if entry.type != "dir":
            raise NotADirectoryInSandbox(f"watch {path!r}: not a directory")
        inside = fsops.physical(sb, entry.symlink_target or full)
        ws = sb.config.workspace.rstrip("/")
        volume = _volume_dir(sb)
        host = os.path.realpath(volume + inside[len(ws):])
        if host != volume and not host.startswith(volume + "/"):
            raise InvalidArgument(f"watch {path!r}: it resolves outside the sandbox work dir")
        return self.add(sb.id, full, host, recursive, include_entry)

    def add(self, sandbox_id: str, path: str, host: str, recursive: bool, include_entry: bool) -> Watch:
        """A watcher of host directory `host` (the sandbox's `path`) for the sandbox, within its caps."""
        with self._lock:  # the cap's check and the claim of a place: one step
            if self._claimed.get(sandbox_id, 0) >= MAX_PER_SANDBOX:
                raise InvalidArgument(f"sandbox {sandbox_id} has {MAX_PER_SANDBOX} watchers already; remove "
                                      "one (handle.stop()) first")
            self._claimed[sandbox_id] = self._claimed.get(sandbox_id, 0) + 1
            budget = self._budgets.setdefault(sandbox_id, DirBudget(MAX_DIRS_PER_SANDBOX))
        try:
            watch = Watch(secrets.token_hex(8), sandbox_id, path, Watcher(host, recursive, budget),
                          include_entry)
        except BaseException:
            self._release(sandbox_id)
            raise
        with self._lock:
            self._watches[watch.id] = watch
        return watch

    def _release(self, sandbox_id: str) -> None:
        with self._lock:
            left = self._claimed.get(sandbox_id, 0) - 1
            if left > 0:
                self._claimed[sandbox_id] = left
            else:
                self._claimed.pop(sandbox_id, None)
                self._budgets.pop(sandbox_id, None)

    def count(self, sandbox_id: str) -> int:
        """The sandbox's watchers."""
        with self._lock:
            return sum(w.sandbox_id == sandbox_id for w in self._watches.values())

    def get(self, watch_id: str, sb: Sandbox) -> Watch:
        with self._lock:
            watch = self._watches.get(watch_id)
        if watch is None or watch.sandbox_id != sb.id:
            raise InvalidArgument(f"no watcher {watch_id!r} in sandbox {sb.id} (removed, or its sandbox was "
                                  "paused)")
        if sb.status != "running":
            self.remove(watch_id)
            raise SandboxStateError(f"sandbox {sb.id} is {sb.status}: its watchers ended")
        return watch

    def remove(self, watch_id: str) -> None:
        with self._lock:
            watch = self._watches.pop(watch_id, None)
        if watch is not None:
            watch.watcher.close()
            self._release(watch.sandbox_id)

    def stale(self) -> list[str]:
        """Ids of watchers whose sandbox no longer runs (paused, killed): their events are over."""
        with self._lock:
            watches = list(self._watches.values())
        out = []
        for w in watches:
            try:
                running = Sandbox.get(w.sandbox_id).status == "running"
            except AgentEnvError:
                running = False
            if not running:
                out.append(w.id)
        return out


def event_path(watch: Watch, ev: Event) -> str:
    return posixpath.join(watch.path, ev.name)
