"""The server's directory watchers (`agentenv/server/watch.py`, `inotify.py`) on real host directories:
the per-sandbox cap holds under concurrent creates, every watcher shares one inotify instance, recursive
watches are bounded in directories, and a directory that appears with content inside reports it all.
(The SDK's watch_dir end to end: tests/server/test_server_e2b.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentenv.server import inotify, watch
from agentenv.server.inotify import DirBudget, Watcher, WatchLimitReached


def _inotify_fds() -> int:
    """This process's open inotify instances."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            pass
    return n


def _collect(w: Watcher, want: set[tuple[str, str]], timeout_s: float = 5.0) -> set[tuple[str, str]]:
    """(kind, name) of the watcher's events until `want` is among them (bounded in time)."""
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + timeout_s
    while not want <= seen and time.monotonic() < deadline:
        seen |= {(e.kind, e.name) for e in w.drain()}
        time.sleep(0.02)
    return seen


def test_concurrent_creates_respect_the_per_sandbox_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "MAX_PER_SANDBOX", 4)
    watches = watch.Watches()
    made, refused = [], []
    start = threading.Barrier(24)

    def create(i: int) -> None:
        start.wait()
        try:
            made.append(watches.add("sb1", f"/workspace/d{i}", str(tmp_path), True, False))
        except Exception as e:  # noqa: BLE001 - collected and checked below
            refused.append(e)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert (len(made), len(refused), watches.count("sb1")) == (4, 20, 4)
    assert all("has 4 watchers already" in str(e) for e in refused), refused[:1]
    watches.remove(made[0].id)  # a place freed is a place to take, by one create only
    assert watches.add("sb1", "/workspace", str(tmp_path), False, False).sandbox_id == "sb1"
    with pytest.raises(Exception, match="has 4 watchers already"):
        watches.add("sb1", "/workspace", str(tmp_path), False, False)
    assert watches.add("sb2", "/workspace", str(tmp_path), False, False)  # another sandbox's own cap
    for w in [*made[1:], *list(watches._watches.values())]:
        watches.remove(w.id)


def test_many_watchers_share_one_inotify_instance(tmp_path):
    inotify.shared()
    before = _inotify_fds()
    dirs = [tmp_path / f"d{i}" for i in range(40)]
    for d in dirs:
        (d / "sub").mkdir(parents=True)
    watchers = [Watcher(str(d), recursive=i % 2 == 0) for i, d in enumerate(dirs)]
    twin = Watcher(str(dirs[1]), recursive=False)  # the same directory twice: one kernel watch, two holders
    try:
        assert _inotify_fds() == before, "a watcher opened its own inotify instance"
        for d in dirs:
            (d / "f.txt").write_text("x")
        for i, w in enumerate(watchers):
            seen = _collect(w, {("create", "f.txt")})
            assert ("create", "f.txt") in seen and all(n == "f.txt" for _k, n in seen), (i, seen)
        assert ("create", "f.txt") in _collect(twin, {("create", "f.txt")})
        watchers[1].close()  # its twin keeps watching the shared directory
        (dirs[1] / "g.txt").write_text("y")
        assert ("create", "g.txt") in _collect(twin, {("create", "g.txt")})
    finally:
        for w in [*watchers, twin]:
            w.close()
    assert _inotify_fds() == before


def test_a_new_directory_reports_what_is_already_inside_it(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    w = Watcher(str(root), recursive=True)
    try:
        subprocess.run(["mkdir", "-p", str(root / "a" / "b" / "c")], check=True)
        want = {("create", "a"), ("create", "a/b"), ("create", "a/b/c")}
        assert want <= _collect(w, want)
        # a whole tree moved in at once: only its top is the kernel's event, the rest comes from the scan
        (tmp_path / "t" / "x" / "y").mkdir(parents=True)
        (tmp_path / "t" / "x" / "y" / "f.txt").write_text("1")
        os.rename(tmp_path / "t", root / "a" / "t")
        want = {("create", "a/t"), ("create", "a/t/x"), ("create", "a/t/x/y"), ("create", "a/t/x/y/f.txt")}
        assert want <= _collect(w, want)
        (root / "a" / "t" / "x" / "y" / "g.txt").write_text("2")  # and the new directories are watched
        assert ("create", "a/t/x/y/g.txt") in _collect(w, {("create", "a/t/x/y/g.txt")})
    finally:
        w.close()


def test_recursive_watches_are_bounded_in_directories(tmp_path):
    tree = tmp_path / "tree"
    for i in range(10):
        (tree / f"d{i}").mkdir(parents=True)
    shared_watches = inotify.shared().watches()
    budget = DirBudget(5)
    with pytest.raises(WatchLimitReached, match="at most 5 directories"):
        Watcher(str(tree), recursive=True, budget=budget)
    assert budget.used == 0 and inotify.shared().watches() == shared_watches  # nothing left behind
    assert Watcher(str(tree), recursive=False, budget=budget).close() is None  # one directory: fits

    # a tree that grows past the bound: its events first, then the error, until the watcher is removed
    small = tmp_path / "small"
    small.mkdir()
    budget = DirBudget(3)
    w = Watcher(str(small), recursive=True, budget=budget)
    try:
        subprocess.run(["mkdir", "-p", str(small / "a" / "b" / "c" / "d")], check=True)
        seen = _collect(w, {("create", "a"), ("create", "a/b")})
        assert {("create", "a"), ("create", "a/b")} <= seen
        assert budget.used == 3
        with pytest.raises(WatchLimitReached, match=r"'a/b/c'.*at most 3 directories"):
            for _ in range(50):
                w.drain()
                time.sleep(0.02)
    finally:
        w.close()
    assert budget.used == 0
    shutil.rmtree(small)


def test_one_sandboxs_watchers_share_its_directory_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "MAX_DIRS_PER_SANDBOX", 6)
    for i in range(4):
        (tmp_path / f"d{i}").mkdir()
    watches = watch.Watches()
    first = watches.add("sb1", "/workspace", str(tmp_path), True, False)  # 5 directories
    with pytest.raises(WatchLimitReached, match="at most 6 directories"):
        watches.add("sb1", "/workspace", str(tmp_path), True, False)
    other = watches.add("sb2", "/workspace", str(tmp_path), True, False)  # another sandbox: its own budget
    assert watches.count("sb1") == 1
    watches.remove(first.id)
    again = watches.add("sb1", "/workspace", str(tmp_path), True, False)  # the budget came back
    for w in (other, again):
        watches.remove(w.id)
    assert Path(tmp_path).is_dir()
