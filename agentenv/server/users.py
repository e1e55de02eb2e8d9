"""Which user a data-plane call asks for, and the one answer this server has: the sandbox user `user`.

E2B's SDK names a user per call (`commands.run(user=...)` as `Authorization: Basic base64("<user>:")`,
the file calls as `?username=`), `user` by default. Every AgentENV sandbox process runs as its one
sandbox user (named `user` in the base image: uid 1000, or uid 0 without capabilities where the host's
CRIU cannot dump another uid), so `user` is served and anything else, E2B's `root` included, is refused
with a message saying why instead of being run with other rights than asked for."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

from agentenv.errors import InvalidArgument

SANDBOX_USER = "user"


def check_user(name: str | None, where: str) -> None:
    """Accept no user or `user`; refuse any other name with InvalidArgument (400 / invalid_argument)."""
    if name in (None, "", SANDBOX_USER):
        return
    why = ("sandboxes have no root: every process runs as the sandbox user without capabilities"
           if name == "root" else "it is not a user of agentenv sandboxes")
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
