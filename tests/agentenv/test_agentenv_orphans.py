"""Sandboxes of a process that died: closed by `agentenv gc` (and the trainer's start), the rest kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from agentenv_testutil import SMALL

from agentenv import Sandbox
from agentenv.backend import docker_client
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


KILLED_MID_CREATE = """
import os, signal, sys
from agentenv import Sandbox, SandboxConfig
from agentenv.runtime import runtime

rt = runtime()
real = rt.backend.create


def create_then_die(spec):  # SIGKILL after Docker made the container, before the row records it
    ref = real(spec)
    print(ref.container, ref.volume, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


rt.backend.create = create_then_die
Sandbox.create(config=SandboxConfig.load(**__import__("json").loads(sys.argv[1])))
"""


def test_gc_removes_a_sandbox_whose_creator_was_killed_mid_create_in_one_pass(small_config):
    """The creator dies between Docker's create and the registry's update: a row still 'creating' and a
    container the row does not name. While the row is recent, gc leaves both (its creator may be at
    work); once stale, one gc removes the row, the container and the volume."""
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_CREATE, json.dumps(SMALL)],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    container, volume = killed.stdout.split()
    api = docker_client.api()
    (row,) = [s for s in Sandbox.list() if s.status == "creating"]
    assert api.inspect_container(container)["State"]["Running"]
    recent = collect_garbage()
    assert row.id not in recent.closed and container[:12] not in recent.removed_containers
    stale = collect_garbage(stale_s=0.0)
    assert row.id in stale.closed and container[:12] in stale.removed_containers
    assert volume in stale.removed_volumes
    assert [c for c in api.containers(all=True) if c["Id"] == container] == []
    assert all(s.id != row.id for s in Sandbox.list(include_closed=True))
