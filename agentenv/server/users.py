"""Which user a data-plane call asks for, and the one answer this server has: the sandbox user `user`.

Every sandbox process runs as its one confined sandbox user, so any other user (E2B's `root` included) is
refused with a message saying what the processes run with, rather than run with other rights than asked.

Design: docs/design/sandboxes.md#agentenv-server-users.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

from agentenv.config import SandboxConfig
from agentenv.errors import InvalidArgument
from agentenv.sandbox import Sandbox

SANDBOX_USER = "user"
_UIDS = {"agent": "uid 1000", "root": "uid 0"}  # the sandbox user's uid, by `Sandbox.user`


def rights(c: SandboxConfig, user: str) -> str:
    """What every process of a sandbox of config `c` and `user` ('agent' | 'root', `Sandbox.user`) runs
    with, as its container is made (`agentenv/backend/containers.py`)."""
    added = f" but {'/'.join(c.cap_add)}" if c.cap_add else ""
    if "ALL" in {cap.upper() for cap in c.cap_drop}:
        caps = "every capability dropped" + added
    else:
        caps = "Docker's default capabilities" + (f" less {'/'.join(c.cap_drop)}" if c.cap_drop else "") + \
            (f" plus {'/'.join(c.cap_add)}" if c.cap_add else "")
    parts = [f"{_UIDS.get(user, user)} with {caps}"]
    if c.no_new_privileges:
        parts.append("no-new-privileges")
    parts.append("a read-only root filesystem" if c.read_only else "a writable root filesystem")
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def check_user(name: str | None, where: str, sb: Sandbox) -> None:
    """Accept no user or `user`; refuse any other name with InvalidArgument (400 / invalid_argument)."""
    if name in (None, "", SANDBOX_USER):
        return
    why = (f"the sandbox has one user, {SANDBOX_USER!r}: {rights(sb.config, sb.user)}; no call runs with "
           "other rights" if name == "root" else "it is not a user of agentenv sandboxes")
    raise InvalidArgument(f"{where}: user {name!r} is not available ({why}); run as {SANDBOX_USER!r} (the "
                          "default)")


def basic_auth_user(headers: Mapping[str, str]) -> str | None:
    """The user name of an `Authorization: Basic base64("<user>:")` header, None without one."""
    value = headers.get("authorization", "")
    scheme, _, blob = value.partition(" ")
    if scheme.lower() != "basic" or not blob:
        return None
    try:
        decoded = base64.b64decode(blob.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidArgument("the Authorization header is not Basic base64('<user>:')") from None
    return decoded.partition(":")[0]
