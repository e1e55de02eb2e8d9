"""The refusal of a user other than the sandbox's (`agentenv/server/users.py`) says what the sandbox's
processes run with, from its config and user, as the backend makes its container."""

from __future__ import annotations

from agentenv.config import SandboxConfig
from agentenv.server.users import rights


def test_rights_name_what_the_container_enforces():
    c = SandboxConfig.load(cap_drop=["ALL"], cap_add=[], no_new_privileges=True, read_only=True)
    assert rights(c, "root") == ("uid 0 with every capability dropped, no-new-privileges and a read-only "
                                 "root filesystem")
    assert rights(c, "agent").startswith("uid 1000 with every capability dropped")
    looser = c.replace(cap_add=["NET_RAW"], no_new_privileges=False, read_only=False)
    assert rights(looser, "root") == ("uid 0 with every capability dropped but NET_RAW and a writable root "
                                      "filesystem")
    assert rights(c.replace(cap_drop=["MKNOD"], cap_add=["SYS_PTRACE"]), "root") == (
        "uid 0 with Docker's default capabilities less MKNOD plus SYS_PTRACE, no-new-privileges and a "
        "read-only root filesystem")
