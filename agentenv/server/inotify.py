"""Directory watchers on Linux inotify (through libc, no dependency), optionally recursive.

Every watcher of the process shares one inotify instance (the host allows few per user), and a recursive
watch counts its directories against a budget (`DirBudget`), so one sandbox cannot exhaust the host's
watches; directories created under a recursive watch are watched at once.

Design: docs/design/sandboxes.md#agentenv-server-inotify.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
from collections import deque
from dataclasses import dataclass

from agentenv.errors import InvalidArgument

IN_MODIFY, IN_ATTRIB = 0x2, 0x4
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_IGNORED, IN_Q_OVERFLOW, IN_ISDIR = 0x400, 0x8000, 0x4000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
_HEADER = struct.Struct("iIII")
_READ_BYTES = 64 * 1024
_MAX_READS = 64       # reads of the queue per pass (a pass never runs forever while events keep coming)
MAX_QUEUED = 10_000   # events kept per watcher until read; older ones are dropped past this
MAX_DIRS = 4096       # directories a watcher (or a group sharing a DirBudget) watches at most

# inotify mask -> envd's event type (as fsnotify, which envd uses, names them)
KINDS = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_MODIFY, "write"), (IN_DELETE, "remove"),
         (IN_MOVED_FROM, "rename"), (IN_ATTRIB, "chmod"))

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class WatchLimitReached(InvalidArgument):
    """A recursive watch would watch more directories than its bound (or the host) allows."""


@dataclass(frozen=True)
class Event:
    name: str      # relative to the watched directory ("sub/file" in a recursive watch)
    kind: str      # create | write | remove | rename | chmod
    is_dir: bool


class DirBudget:
    """How many directories the watchers sharing it may watch together (thread-safe)."""

    def __init__(self, limit: int = MAX_DIRS) -> None:
        if limit < 1:
            raise ValueError(f"a directory budget must allow at least 1 directory, got {limit}")
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.limit:
                return False
            self.used += 1
            return True

    def give(self, n: int = 1) -> None:
        with self._lock:
            self.used = max(self.used - n, 0)


class Inotify:
    """One inotify instance and its reader thread, shared by watchers: a table of watch descriptor ->
    {watcher: its path of that directory}. One lock (re-entrant: a watcher adds watches while an event is
    handed to it) guards the descriptor, the table and every read."""

    def __init__(self) -> None:
        self._fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, "inotify_init1 failed: " + os.strerror(err))
        self.lock = threading.RLock()
        self._table: dict[int, dict[Watcher, str]] = {}
        self._thread = threading.Thread(target=self._run, name="inotify", daemon=True)
        self._thread.start()

    def add(self, watcher: Watcher, path: str, rel: str) -> int:
        """Watch directory `path` for `watcher` (which names it `rel`); its descriptor, or -errno."""
        with self.lock:
            wd = _libc.inotify_add_watch(self._fd, path.encode("utf-8", "surrogateescape"),
                                         _MASK | IN_ONLYDIR | IN_DONT_FOLLOW)
            if wd < 0:
                return -ctypes.get_errno()
            self._table.setdefault(wd, {})[watcher] = rel
            return wd

    def drop(self, watcher: Watcher, wds: set[int]) -> None:
        """`watcher` no longer watches these; a descriptor no watcher holds any more is removed."""
        with self.lock:
            for wd in wds:
                holders = self._table.get(wd)
                if holders is None:
                    continue
                holders.pop(watcher, None)
                if not holders:
                    del self._table[wd]
                    _libc.inotify_rm_watch(self._fd, wd)  # its IN_IGNORED then finds no holder

    def watches(self) -> int:
        """Kernel watches this instance holds."""
        with self.lock:
            return len(self._table)

    def read(self) -> None:
        """Read what the kernel has queued and hand each event to its watchers."""
        with self.lock:
            for _ in range(_MAX_READS):
                try:
                    data = os.read(self._fd, _READ_BYTES)
                except BlockingIOError:
                    return
                self._dispatch(data)

    def _run(self) -> None:
        while True:
            select.select([self._fd], [], [], 1.0)
            self.read()

    def _dispatch(self, data: bytes) -> None:
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size: offset + _HEADER.size + length]
            offset += _HEADER.size + length
            if mask & IN_Q_OVERFLOW:  # the kernel dropped events: of any watcher
                for watcher in {w for holders in self._table.values() for w in holders}:
                    watcher.dropped += 1
                continue
            if mask & IN_IGNORED:  # the directory is gone (or was unwatched)
                for watcher in self._table.pop(wd, {}):
                    watcher.forget(wd)
                continue
            name = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if name:
                for watcher, base in list(self._table.get(wd, {}).items()):
                    watcher.handle(wd, base, name, mask)


_shared: Inotify | None = None
_shared_lock = threading.Lock()


def shared() -> Inotify:
    """The process's inotify instance (made at the first watcher)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Inotify()
        return _shared


class Watcher:
    """Events under `root` (a host directory) from now on; `recursive` also watches subdirectories,
    those created later included, within `budget` (default: its own, `MAX_DIRS`). `drain()` takes what
    has arrived; `close()` ends it. WatchLimitReached when the tree has more directories than the budget
    allows; OSError when `root` cannot be watched."""

    def __init__(self, root: str, recursive: bool, budget: DirBudget | None = None,
                 inotify: Inotify | None = None) -> None:
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self.events: deque[Event] = deque(maxlen=MAX_QUEUED)
        self.dropped = 0
        self.error: WatchLimitReached | None = None  # set once a directory could not be watched
        self._budget = budget or DirBudget()
        self._inotify = inotify or shared()
        self._wds: set[int] = set()
        self._lock = threading.Lock()  # the event queue
        self._closed = False
        try:
            with self._inotify.lock:  # no event of this watcher is handed over before it is complete
                self._add("", report=False)
        except BaseException:
            self.close()
            raise
        if self.error is not None:
            error = self.error
            self.close()
            raise error

    def _add(self, rel: str, report: bool) -> None:
        """Watch directory `rel` (and, recursively, its subdirectories); `report`: what it holds now is
        new to the client (a directory just created), reported as created."""
        if self.error is not None or self._closed:
            return
        path = os.path.join(self.root, rel) if rel else self.root
        if not self._budget.take():
            self._limit(rel, f"the watch may cover at most {self._budget.limit} directories (together with "
                             "the other watchers of its sandbox)")
            return
        wd = self._inotify.add(self, path, rel)
        if wd < 0 or wd in self._wds:
            self._budget.give()
        if wd < 0:
            if not rel:
                raise OSError(-wd, f"cannot watch {path}: {os.strerror(-wd)}")
            if -wd == errno.ENOSPC:
                self._limit(rel, "the host's inotify watches (fs.inotify.max_user_watches) are used up")
            return  # a subdirectory gone or replaced meanwhile: nothing to watch there
        self._wds.add(wd)
        if not self.recursive:
            return
        try:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in os.scandir(path)]
        except OSError:
            return
        for name, is_dir in sorted(entries):
            sub = os.path.join(rel, name) if rel else name
            if report:
                self._queue(Event(sub, "create", is_dir))
            if is_dir:
                self._add(sub, report)

    def _limit(self, rel: str, why: str) -> None:
        shown = repr(rel) if rel else "the watched directory"
        self.error = WatchLimitReached(f"directory {shown} (under the watched directory) is not watched: "
                                       f"{why}; watch a smaller tree, or without recursive")

    def handle(self, wd: int, base: str, name: str, mask: int) -> None:
        """An event of directory `base` (descriptor `wd`) about its entry `name` (from `Inotify`)."""
        rel = os.path.join(base, name) if base else name
        is_dir = bool(mask & IN_ISDIR)
        for bits, kind in KINDS:
            if mask & bits:
                self._queue(Event(rel, kind, is_dir))
        if self.recursive and is_dir and mask & (IN_CREATE | IN_MOVED_TO):
            self._add(rel, report=True)

    def forget(self, wd: int) -> None:
        """The kernel removed watch `wd` (its directory is gone)."""
        if wd in self._wds:
            self._wds.discard(wd)
            self._budget.give()

    def _queue(self, event: Event) -> None:
        with self._lock:
            if len(self.events) == self.events.maxlen:
                self.dropped += 1
            self.events.append(event)

    def drain(self) -> list[Event]:
        """The events that arrived since the last drain (what the kernel has queued is read first);
        once they are all taken, WatchLimitReached if a directory could not be watched."""
        if not self._closed:
            self._inotify.read()  # what is queued now, so a change made just before the call is in its answer
        with self._lock:
            out = list(self.events)
            self.events.clear()
        if not out and self.error is not None:
            raise self.error
        return out

    def close(self) -> None:
        with self._inotify.lock:
            if self._closed:
                return
            self._closed = True
            self._inotify.drop(self, self._wds)
            self._budget.give(len(self._wds))
            self._wds.clear()
