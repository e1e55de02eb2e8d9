"""fork(n): every fork restores the source's memory and files and then lives its own life."""

from __future__ import annotations

import threading
import time

import pytest
from agentenv_testutil import count, start_counter

from agentenv import Sandbox
from agentenv.errors import AgentEnvError

pytestmark = pytest.mark.docker


def test_fork_4_gives_independent_continuations_with_the_source_files(sandbox):
    start_counter(sandbox)
    sandbox.write_file("before.txt", "written before the fork")
    sandbox.exec("echo tmpfs-state > /tmp/state")
    sandbox.pause()
    forks = sandbox.fork(4)
    assert len(forks) == 4 and len({f.id for f in forks}) == 4
    assert sandbox.status == "paused"  # a paused source stays paused
    for i, f in enumerate(forks):
        assert f.status == "running" and f.parent_id == sandbox.id
        assert f.read_file("before.txt") == b"written before the fork"
        assert f.exec("cat /tmp/state").stdout == "tmpfs-state\n"
        assert f.exec("cat /run/agentenv/sandbox-id").stdout == f.id
        f.write_file("mine.txt", f"fork {i}")
    counts = [count(f) for f in forks]
    time.sleep(0.3)
    assert all(count(f) > c for f, c in zip(forks, counts, strict=True))  # each one keeps counting
    for i, f in enumerate(forks):
        others = f.exec("cat /workspace/mine.txt; ls /workspace").stdout
        assert others.startswith(f"fork {i}") and others.count("mine.txt") == 1
    seeds = {f.exec("cat /run/agentenv/seed").stdout for f in forks}
    assert len(seeds) == 4  # a fresh seed per fork for programs that must not act identically
    sandbox.resume()
    assert sandbox.exec("ls /workspace").stdout.split() == ["before.txt"]  # forks' files stay in forks


def test_forking_a_running_sandbox_pauses_and_resumes_it(sandbox):
    start_counter(sandbox)
    (fork,) = sandbox.fork(1)
    assert sandbox.status == "running"
    assert count(sandbox) > 0 and count(fork) > 0
    assert sandbox.stats().checkpoint_bytes == 0


def test_a_failed_fork_leaves_no_fork_and_the_running_source_running(sandbox, monkeypatch):
    """The source's own restore runs alongside its forks'; when one fork cannot be restored, all forks
    go (all or nothing) and the source still comes back, counting on from its checkpoint."""
    from agentenv.errors import CheckpointError

    start_counter(sandbox)
    sandbox.write_file("kept.txt", "source file")
    backend = sandbox._rt.backend
    real_restore = type(backend).restore
    source_container = sandbox._record().container
    restored: list[str] = []
    failed: list[str] = []
    calls = threading.Lock()  # the source's and the forks' restores run on threads of their own

    def restore(self, ref, checkpoint, *, sandbox_id):
        with calls:
            restored.append(sandbox_id)
            fails = ref.container != source_container and not failed  # the first fork to get here
            if fails:
                failed.append(sandbox_id)
        if fails:
            raise CheckpointError("injected: this fork's restore failed")
        return real_restore(self, ref, checkpoint, sandbox_id=sandbox_id)

    monkeypatch.setattr(type(backend), "restore", restore)
    before = {s.id for s in Sandbox.list()}
    with pytest.raises(CheckpointError, match="injected"):
        sandbox.fork(3)
    monkeypatch.undo()
    assert sandbox.id in restored and len(restored) == 4  # the source and three forks were restored
    assert {s.id for s in Sandbox.list()} == before  # no fork left behind
    assert sandbox.status == "running" and sandbox.stats().checkpoint_bytes == 0
    assert sandbox.read_file("kept.txt") == b"source file"
    c = count(sandbox)
    time.sleep(0.3)
    assert count(sandbox) > c


def test_fork_carries_the_writable_layer_when_the_root_is_writable(make_sandbox):
    sb = make_sandbox(read_only=False)
    sb.exec("echo layer > /var/tmp/in-layer")
    (fork,) = sb.fork(1)
    assert fork.exec("cat /var/tmp/in-layer").stdout == "layer\n"
    fork.exec("echo fork-only > /var/tmp/fork-only")
    assert sb.exec("test -e /var/tmp/fork-only").exit_code == 1


def test_bad_fork_counts_are_refused(sandbox):
    for n in (0, -1, 65, 1.5, True):
        with pytest.raises(AgentEnvError, match="fork count"):
            sandbox.fork(n)
    sandbox.close()
    with pytest.raises(AgentEnvError, match="closed"):
        sandbox.fork(1)
    assert [s for s in Sandbox.list() if s.parent_id == sandbox.id] == []
