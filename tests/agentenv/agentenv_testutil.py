"""Helpers shared by the AgentENV tests (imported by name; pytest puts this folder on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Small sandboxes keep the suite fast and light on a 2-core machine.
SMALL = {"memory": "128m", "cpus": 1.0, "pids_limit": 64, "tmpfs": {"/tmp": "size=32m,mode=1777"},
         "exec_timeout_s": 30.0, "lock_timeout_s": 60.0}
# A process whose random token lives only in memory (a tmpfs file): after a resume, a thaw or in a fork it
# must be the same one.
TOKEN_PROCESS = (
    'nohup python3 -c "import os,time; t=os.urandom(8).hex(); '
    "open('/tmp/token','w').write(t); time.sleep(10**6)\" >/dev/null 2>&1 & "
    "while [ ! -s /tmp/token ]; do sleep 0.05; done"
)


def run_cli(*args: str, stdin: bytes | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real `agentenv` command in a subprocess (same interpreter, same $AGENTENV_HOME)."""
    return subprocess.run([sys.executable, "-m", "agentenv.cli", *args], input=stdin, capture_output=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


# Counts every 50 ms into /tmp/count (written atomically, so a reader never sees it half-written).
COUNTER = ("nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; "
           "mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &")


def count(sb) -> int:
    return int(sb.exec("cat /tmp/count").stdout)


def start_counter(sb) -> int:
    sb.exec(COUNTER)
    deadline = time.monotonic() + 10
    while sb.exec("test -s /tmp/count").exit_code != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return count(sb)
