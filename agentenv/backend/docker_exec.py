"""Run commands in a running container through Docker's exec API, with AgentENV's guarantees.

A command is always killed at its deadline (its whole process group), its output is capped without ever
blocking it, and its stdin cannot deadlock it; `DockerShell` is a session's shell, read and killed the
same way.

Design: docs/design/sandboxes.md#agentenv-backend-docker-exec.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence

import docker

from agentenv.backend import docker_client
from agentenv.backend.base import RawExec, ShellStream
from agentenv.backend.cgroups import cgroup_pids
from agentenv.backend.commands import HOST_GRACE_S, KILL_GRACE_S, CappedOutput, is_timeout, timeout_argv

_HEADER = struct.Struct(">BxxxL")
_RECV_BYTES = 256 * 1024


class ExecStream:
    """The hijacked connection of a started exec, read as Docker's multiplexed stream: frames of an
    8-byte header (stream 1 = stdout, 2 = stderr; payload size) and the payload.

    Reads go straight to the socket with an absolute deadline (a timeout leaves the stream intact, unlike
    a buffered file object), so a caller can also ask whether a frame is waiting (`ready`).
    """

    def __init__(self, api: docker.APIClient, exec_id: str) -> None:
        res = api._post_json(api._url("/exec/{0}/start", exec_id), data={"Tty": False, "Detach": False},
                             headers={"Connection": "Upgrade", "Upgrade": "tcp"}, stream=True)
        api._raise_for_status(res)
        self._res = res
        fp = res.raw._fp.fp                      # http.client's buffered reader of the response
        self.sock: socket.socket = fp.raw._sock
        self.sock.setblocking(False)
        self._buf = bytearray(fp.peek())         # output it read past the headers (no wait: non-blocking)
        self.sock.setblocking(True)
        self.eof = False

    def read_frame(self, deadline: float) -> tuple[int, bytes] | None:
        """The next (stream, payload), or None once the daemon closed the stream. TimeoutError after
        `deadline` (time.monotonic) with the frame incomplete; the stream stays usable."""
        if not self._fill(_HEADER.size, deadline):
            return None
        stream, size = _HEADER.unpack_from(self._buf)
        if not self._fill(_HEADER.size + size, deadline):
            return None
        payload = bytes(self._buf[_HEADER.size:_HEADER.size + size])
        del self._buf[:_HEADER.size + size]
        return stream, payload

    def _fill(self, n: int, deadline: float) -> bool:
        while len(self._buf) < n:
            if self.eof:
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no output before the deadline")
            self.sock.settimeout(remaining)
            data = self.sock.recv(_RECV_BYTES)
            if not data:
                self.eof = True
                return False
            self._buf += data
        return True

    def ready(self) -> bool:
        """Can `read_frame` return something (a frame, or the end) without waiting?"""
        if self._buf or self.eof:
            return True
        return bool(select.select([self.sock], [], [], 0)[0])

    def send(self, data: bytes) -> None:
        self.sock.settimeout(None)
        self.sock.sendall(data)

    def close(self) -> None:
        """Close this process's end of the connection (never `shutdown`: a forked process may share it)."""
        with contextlib.suppress(Exception):
            self._res.close()
        with contextlib.suppress(OSError):
            self.sock.close()


def start_exec(api: docker.APIClient, container: str, argv: Sequence[str], *, user: str, stdin: bool,
               env: Mapping[str, str] | None = None, workdir: str | None = None) -> tuple[str, ExecStream]:
    """Create and start an exec (no TTY); its id and attached stream."""
    exec_id = api.exec_create(container, list(argv), stdout=True, stderr=True, stdin=stdin, tty=False,
                              user=user, environment=dict(env) if env else None, workdir=workdir)["Id"]
    return exec_id, ExecStream(api, exec_id)


class DockerShell(ShellStream):
    """A shell started with `docker exec -i` (see `SandboxBackend.open_shell`)."""

    def __init__(self, exec_id: str, stream: ExecStream) -> None:
        self.exec_id = exec_id
        self._stream = stream

    def send(self, data: bytes) -> None:
        self._stream.send(data)

    def read_frame(self, deadline: float) -> tuple[int, bytes] | None:
        return self._stream.read_frame(deadline)

    def ready(self) -> bool:
        return self._stream.ready()

    def kill(self) -> None:
        pid, init_pid = exec_pids(docker_client.api(), self.exec_id)
        if pid > 0:
            kill_attached([pid], init_pid)

    def exit_code(self) -> int:
        try:
            return _exit_code(docker_client.api(), self.exec_id)
        except (docker.errors.DockerException, OSError):  # the daemon does not answer (requests: OSError)
            return -1

    def close(self) -> None:
        self._stream.close()


def _pipes(pid: int) -> set[str]:
    """The pipes ('pipe:[inode]') that are process `pid`'s stdin, stdout and stderr."""
    out = set()
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("pipe:"):
                out.add(target)
    return out


def _holds_any(pid: int, pipes: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in pipes:
                return True
    return False


def attached_processes(pid: int) -> list[int]:
    """Host pids of the processes in `pid`'s container that hold one of the pipes `pid` (an exec's
    process) has as stdio: the exec itself, its commands and any background job that kept them.
    These are what CRIU cannot dump (the pipes lead to the Docker daemon)."""
    pipes = _pipes(pid)
    if not pipes:
        return []
    return [p for p in cgroup_pids(pid) if _holds_any(p, pipes)]


def kill_attached(pids: Sequence[int], init_pid: int, wait_s: float = 5.0) -> None:
    """SIGKILL the processes attached to these execs' pipes and the process groups they lead (a
    `timeout` leads its command's group); wait up to `wait_s` until they are gone. Needs root on the
    Docker host (it signals host pids).

    Only processes of the container whose init is `init_pid` are signalled, never the init itself: an
    exec's pid comes from Docker, which may still report an exec running after it exited, and the host
    reuses pids (pid_max can be 32768), so the pid may by now name a process of another container or of
    the host."""
    members = set(cgroup_pids(init_pid)) - {init_pid}
    init_group = _pgid(init_pid)
    victims: set[int] = set()
    for pid in pids:
        if pid in members:
            victims.update(p for p in attached_processes(pid) if p in members)
            victims.add(pid)
    for p in victims:
        if _pgid(p) == p and p != init_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in victims) and time.monotonic() < deadline:
        time.sleep(0.01)


def _pgid(pid: int) -> int:
    """The process group of `pid`; 0 when it is gone or unknown."""
    try:
        return os.getpgid(pid) if pid > 0 else 0
    except (ProcessLookupError, PermissionError):
        return 0


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it holds no pipe and its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _feed_stdin(raw: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        raw.sendall(data)
    with contextlib.suppress(OSError):
        raw.shutdown(socket.SHUT_WR)  # the daemon closes the command's stdin


def exec_pids(api: docker.APIClient, exec_id: str) -> tuple[int, int]:
    """(the host pid of an exec's process, the host pid of its container's init); 0 for what is unknown."""
    with contextlib.suppress(Exception):
        info = api.exec_inspect(exec_id)
        pid = int(info.get("Pid") or 0)
        init = int(api.inspect_container(info["ContainerID"])["State"].get("Pid") or 0)
        return pid, init
    return 0, 0


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
    t0 = time.perf_counter()
    exec_id, stream = start_exec(api, container, timeout_argv(argv, timeout_s), user=user,
                                 stdin=stdin is not None, env=env, workdir=workdir)
    if stdin is not None:
        threading.Thread(target=_feed_stdin, args=(stream.sock, stdin), daemon=True).start()
    outs = (CappedOutput(output_limit), CappedOutput(output_limit))
    deadline = time.monotonic() + timeout_s + KILL_GRACE_S + HOST_GRACE_S
    killed_by_host = False
    try:
        while (frame := stream.read_frame(deadline)) is not None:
            kind, payload = frame
            if kind in (1, 2):
                outs[kind - 1].add(payload)
    except (TimeoutError, OSError):
        killed_by_host = True
        pid, init_pid = exec_pids(api, exec_id)
        if pid > 0:
            kill_attached([pid], init_pid)
    finally:
        stream.close()
    exit_code = _exit_code(api, exec_id)
    duration = time.perf_counter() - t0
    timed_out = killed_by_host or is_timeout(exit_code, duration, timeout_s)
    return RawExec(exit_code, bytes(outs[0].data), bytes(outs[1].data), duration, timed_out,
                   outs[0].truncated or outs[1].truncated)
