"""Sandboxes of a process that died: closed by `agentenv gc` (and the trainer's start), the rest kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentenv import Sandbox
from agentenv.gc import close_orphans, collect_garbage
from agentenv.owner import OWNER_LABEL, owner_alive, owner_labels

pytestmark = pytest.mark.docker


def dead_owner_labels() -> dict[str, str]:
    """The owner label of a process that has exited (taken while it ran)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    labels = owner_labels(child.pid)
    child.communicate(b"")
    return labels


def test_owner_labels_tell_a_live_process_from_a_gone_one():
    assert owner_alive(owner_labels()[OWNER_LABEL])
    assert not owner_alive(dead_owner_labels()[OWNER_LABEL])
    boot, pid, ticks = owner_labels()[OWNER_LABEL].split(":")
    assert not owner_alive(f"{boot}:{pid}:{int(ticks) + 1}")  # a reused pid is another process
    assert not owner_alive(f"another-boot:{pid}:{ticks}")
    assert owner_alive("not-an-owner")  # cannot be judged: never closed


def test_gc_closes_the_sandboxes_of_a_dead_owner_only(small_config):
    orphan = Sandbox.create(config=small_config, labels=dead_owner_labels())
    orphan.exec("echo state > /workspace/f")
    orphan.pause()  # paused ones too
    mine = Sandbox.create(config=small_config, labels=owner_labels())
    unowned = Sandbox.create(config=small_config)
    try:
        assert close_orphans(dry_run=True) == [orphan.id] and orphan.status == "paused"
        assert collect_garbage().closed_orphans == [orphan.id]
        assert orphan.status == "closed" and "owner process" in (Sandbox.get(orphan.id).reason or "")
        assert mine.exec("true").exit_code == 0 and unowned.exec("true").exit_code == 0
        assert close_orphans() == []
    finally:
        for sb in (orphan, mine, unowned):
            sb.close()
