"""Run one command in a running container through Docker's exec API, with AgentENV's guarantees:

- the command runs under coreutils `timeout`, which makes it a process-group leader and, at the
  deadline, signals the whole group (TERM, then KILL after a grace period); should even that fail, the
  host kills the group by its host pid;
- stdout and stderr are read from the multiplexed stream and each capped at `output_limit` bytes (the
  rest is read and dropped, so the command is never blocked by a full pipe); `truncated` says so;
- stdin is written by a helper thread, so a command that writes before it reads cannot deadlock.

Three API calls per exec (create, start, inspect) on the shared client: ~30 ms on an idle machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence

import docker

from agentenv.backend.base import RawExec

KILL_GRACE_S = 2.0    # from TERM to KILL inside the container
HOST_GRACE_S = 5.0    # after that, the host kills the group itself
TIMEOUT_EXIT_CODES = (124, 137)
_HEADER = struct.Struct(">BxxxL")


def _feed_stdin(raw: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        raw.sendall(data)
    with contextlib.suppress(OSError):
        raw.shutdown(socket.SHUT_WR)  # the daemon closes the command's stdin


def _read_exact(fp, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = fp.read1(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _kill_host_group(api: docker.APIClient, exec_id: str) -> None:
    """Backstop: kill the exec's process group from the host (its `timeout` process leads the group)."""
    with contextlib.suppress(Exception):
        pid = int(api.exec_inspect(exec_id).get("Pid") or 0)
        if pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _exit_code(api: docker.APIClient, exec_id: str) -> int:
    """The exit code; the daemon may need a few ms after the stream closes to record it."""
    deadline = time.monotonic() + 5.0
    while True:
        info = api.exec_inspect(exec_id)
        if not info.get("Running") and info.get("ExitCode") is not None:
            return int(info["ExitCode"])
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.005)


def run_exec(api: docker.APIClient, container: str, argv: Sequence[str], *, user: str, timeout_s: float,
             output_limit: int, stdin: bytes | None = None, env: Mapping[str, str] | None = None,
             workdir: str | None = None) -> RawExec:
    wrapped = ["timeout", "-k", f"{KILL_GRACE_S:g}", f"{timeout_s:g}", *argv]
    t0 = time.perf_counter()
    exec_id = api.exec_create(container, wrapped, stdout=True, stderr=True, stdin=stdin is not None,
                              tty=False, user=user, environment=dict(env) if env else None,
                              workdir=workdir)["Id"]
    res = api._post_json(api._url("/exec/{0}/start", exec_id), data={"Tty": False, "Detach": False},
                         headers={"Connection": "Upgrade", "Upgrade": "tcp"}, stream=True)
    api._raise_for_status(res)
    fp = res.raw._fp.fp            # the buffered reader http.client used: it may already hold output
    raw: socket.socket = fp.raw._sock
    raw.settimeout(timeout_s + KILL_GRACE_S + HOST_GRACE_S)
    if stdin is not None:
        threading.Thread(target=_feed_stdin, args=(raw, stdin), daemon=True).start()

    outs = (bytearray(), bytearray())
    truncated = False
    killed_by_host = False
    try:
        while True:
            header = _read_exact(fp, _HEADER.size)
            if len(header) < _HEADER.size:
                break
            stream, size = _HEADER.unpack(header)
            payload = _read_exact(fp, size)
            if stream not in (1, 2):
                continue
            buf = outs[stream - 1]
            room = output_limit - len(buf)
            if len(payload) > room:
                truncated = True
                payload = payload[: max(room, 0)]
            buf += payload
    except (TimeoutError, OSError):
        killed_by_host = True
        _kill_host_group(api, exec_id)
    finally:
        with contextlib.suppress(Exception):
            res.close()
    exit_code = _exit_code(api, exec_id)
    duration = time.perf_counter() - t0
    timed_out = killed_by_host or (exit_code in TIMEOUT_EXIT_CODES and duration >= timeout_s * 0.98)
    return RawExec(exit_code, bytes(outs[0]), bytes(outs[1]), duration, timed_out, truncated)
