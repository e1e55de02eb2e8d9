"""A branch of a tree rollout at the sandbox level: the children of a branch node are forks of its paused
sandbox, so both see what the shared prefix did and neither sees what its sibling does after the branch."""

from __future__ import annotations

import pytest

from agentenv import Sandbox, SandboxConfig

pytestmark = pytest.mark.docker


def test_children_share_the_prefix_and_not_each_others_turns(sandbox_config):
    root = Sandbox.create(config=SandboxConfig.from_dict(sandbox_config))
    children: list[Sandbox] = []
    try:
        root.write_file("prefix.txt", "planted before the branch")  # the shared turns' effect
        root.pause()
        children = root.fork(2)
        for i, child in enumerate(children):
            assert child.read_file("prefix.txt") == b"planted before the branch"
            child.write_file(f"child{i}.txt", f"turn of child {i}")
        for i, child in enumerate(children):
            listing = child.exec("ls /workspace").stdout.split()
            assert sorted(listing) == sorted(["prefix.txt", f"child{i}.txt"])
            assert f"child{1 - i}.txt" not in listing
    finally:
        for sb in [*children, root]:
            sb.close()
