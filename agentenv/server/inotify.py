"""A directory watcher on Linux inotify (through libc, no dependency), optionally recursive.

`agentenv serve` watches a sandbox's directory from the host, on the work-dir volume's own directory
(`watch.py`): inotify sees every change a process of the sandbox makes there, with no process of ours
inside it. A thread per watcher reads the kernel's queue as events arrive, so a directory created in a
recursive watch is watched at once, before the files written into it."""

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

IN_MODIFY, IN_ATTRIB = 0x2, 0x4
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_IGNORED, IN_Q_OVERFLOW, IN_ISDIR = 0x400, 0x8000, 0x4000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
_HEADER = struct.Struct("iIII")
MAX_QUEUED = 10_000  # events kept per watcher until read; older ones are dropped past this

# inotify mask -> envd's event type (as fsnotify, which envd uses, names them)
KINDS = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_MODIFY, "write"), (IN_DELETE, "remove"),
         (IN_MOVED_FROM, "rename"), (IN_ATTRIB, "chmod"))

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@dataclass(frozen=True)
class Event:
    name: str      # relative to the watched directory ("sub/file" in a recursive watch)
    kind: str      # create | write | remove | rename | chmod
    is_dir: bool


class Watcher:
    """Events under `root` (a host directory) from now on; `recursive` also watches subdirectories,
    those created later included. `drain()` takes what has arrived; `close()` ends it."""

    def __init__(self, root: str, recursive: bool) -> None:
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self.events: deque[Event] = deque(maxlen=MAX_QUEUED)
        self.dropped = 0
        self._dirs: dict[int, str] = {}  # watch descriptor -> path relative to root ("" = root)
        self._lock = threading.Lock()       # the event queue
        self._reading = threading.Lock()    # the inotify fd and the watch table: one reader at a time
        self._stop = threading.Event()
        self._fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed: " + os.strerror(ctypes.get_errno()))
        try:
            self._add("")
        except BaseException:
            os.close(self._fd)
            raise
        self._thread = threading.Thread(target=self._run, name=f"inotify {root}", daemon=True)
        self._thread.start()

    def _add(self, rel: str) -> None:
        path = os.path.join(self.root, rel) if rel else self.root
        wd = _libc.inotify_add_watch(self._fd, path.encode(), _MASK | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd < 0:
            err = ctypes.get_errno()
            if rel:  # a subdirectory gone or replaced meanwhile: nothing to watch there
                return
            raise OSError(err, f"cannot watch {path}: {os.strerror(err)}")
        self._dirs[wd] = rel
        if self.recursive:
            try:
                subdirs = [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
            except OSError:
                return
            for name in subdirs:
                self._add(os.path.join(rel, name) if rel else name)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._fd], [], [], 0.2)
            except (OSError, ValueError):
                return
            if ready:
                with self._reading:
                    if not self._stop.is_set():
                        self._read()

    def _read(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in (errno.EBADF, errno.EINVAL):
                return
            raise
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size: offset + _HEADER.size + length]
            offset += _HEADER.size + length
            name = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if mask & IN_Q_OVERFLOW:
                self.dropped += 1
                continue
            if mask & IN_IGNORED:
                self._dirs.pop(wd, None)
                continue
            base = self._dirs.get(wd)
            if base is None or not name:
                continue
            rel = os.path.join(base, name) if base else name
            is_dir = bool(mask & IN_ISDIR)
            if self.recursive and is_dir and mask & (IN_CREATE | IN_MOVED_TO):
                self._add(rel)
            with self._lock:
                for bits, kind in KINDS:
                    if mask & bits:
                        if len(self.events) == self.events.maxlen:
                            self.dropped += 1
                        self.events.append(Event(rel, kind, is_dir))

    def drain(self) -> list[Event]:
        """The events that arrived since the last drain (what the kernel has queued is read first)."""
        with self._reading:  # what is queued now, so a change made just before the call is in its answer
            if not self._stop.is_set():
                self._read()
        with self._lock:
            out = list(self.events)
            self.events.clear()
        return out

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2)
        with self._reading:
            os.close(self._fd)
