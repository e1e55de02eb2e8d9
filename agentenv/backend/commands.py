"""How a command runs in a sandbox, whichever way it is started (an exec, a session's shell): under
coreutils `timeout` in its own process group (TERM at the deadline, KILL after a grace period, the host's
kill after another), and with each output stream kept up to a cap (the rest read and dropped)."""

from __future__ import annotations

from collections.abc import Sequence

KILL_GRACE_S = 2.0    # from TERM to KILL inside the container
HOST_GRACE_S = 5.0    # after that, the host kills the processes itself
TIMEOUT_EXIT_CODES = (124, 137)


def timeout_argv(argv: Sequence[str], timeout_s: float) -> list[str]:
    """`argv` under coreutils `timeout`: its own process group, TERM at `timeout_s`, KILL after the grace."""
    return ["timeout", "-k", f"{KILL_GRACE_S:g}", f"{timeout_s:g}", *argv]


def is_timeout(exit_code: int, duration_s: float, timeout_s: float) -> bool:
    """Did `timeout` end the command? (124/137 alone could be the command's own status.)"""
    return exit_code in TIMEOUT_EXIT_CODES and duration_s >= timeout_s * 0.98


class CappedOutput:
    """One output stream kept up to `limit` bytes; the rest is counted and dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.total = 0

    def add(self, payload: bytes) -> None:
        self.total += len(payload)
        room = self.limit - len(self.data)
        if room > 0:
            self.data += payload[:room]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit
