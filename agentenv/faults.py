"""Crash points for tests: with `$AGENTENV_FAULT=<name>` set, the process SIGKILLs itself when it reaches
`crash_point(<name>)`, exactly as a `kill -9` at that moment would (no cleanup, no `finally`). Tests of
recovery use it to stop a process between two steps that a real kill could only hit by chance. Unset
(always, outside those tests), a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "AGENTENV_FAULT"


def crash_point(name: str) -> None:
    """SIGKILL this process here when `$AGENTENV_FAULT` is `name`."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
