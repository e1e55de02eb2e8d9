"""`Session`: a persistent shell in a running sandbox, so that many small commands avoid one exec each.

Why: one `Sandbox.exec` costs three Docker API calls and a runc exec (~30 ms on an idle machine, far more
on a busy one), while a command written to an already running shell costs a fork and an `execve` or two.
A training run of the default task issues tens of thousands of commands.

Guarantees, the same as `Sandbox.exec` and built from the same pieces (`agentenv.backend.docker_exec`,
the process-wide Docker client of `agentenv.backend.docker_client`): `run()` returns an `ExecResult` with
stdout and stderr apart, each capped at the sandbox's `output_limit_bytes` (`truncated` set, the excess
read and dropped); the command runs under coreutils `timeout` in its own process group, which gets TERM
at the deadline and KILL after a grace period (a child that ignores TERM dies too), and the session stays
usable after it. Should even that fail, the host kills every process attached to the session's pipes and
the next `run()` starts a new shell.

Protocol: the shell (`sh -s`) reads one command line per `run()`: the argv `Sandbox.exec` would run,
under `timeout`, with stdin from /dev/null (or from the given bytes), stdout and stderr to the shell's
own, then a `printf` of an end marker (a fresh random nonce per command) to each stream, the exit code
on stdout's. Nothing of one command survives into the next (each runs in its own `sh -c`), so a new shell
is indistinguishable from the old one except for its cost; `reopened` says when one had to be started.

Pause and fork: a session shell's stdio are pipes to the Docker daemon, which no checkpoint can carry:
depending on the CRIU setup the dump fails on them, or the shell and every job still attached to them
come back from a restore cut off from any caller. `Sandbox.pause` (and `fork`, which pauses) therefore
ends every session shell of the sandbox first, from whichever process opened it (`end_sessions`),
together with anything still attached to its pipes; a session notices on its next `run()` and opens a
new shell. After `os.fork` a session used in the child opens the child's own shell.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import docker
import requests

from agentenv.backend import docker_client
from agentenv.backend.base import UIDS, RawExec
from agentenv.backend.docker_exec import (
    HOST_GRACE_S,
    KILL_GRACE_S,
    CappedOutput,
    ExecStream,
    exec_pid,
    is_timeout,
    kill_attached,
    start_exec,
    timeout_argv,
)
from agentenv.errors import AgentEnvError
from agentenv.results import ExecResult
from agentenv.sandbox import _argv, _positive, _state_error, _stdin_bytes

if TYPE_CHECKING:
    from agentenv.sandbox import Sandbox

# The shell's argv; `end_sessions` recognises session shells by it. `$1` only labels the process.
SESSION_ARGV = ("sh", "-s", "--", "agentenv-session")
KILLED_EXIT_CODE = 137   # reported when the host had to kill the command (128 + SIGKILL)
_DRAIN_S = 0.05          # at most this long spent dropping stray output before a command


class SessionError(AgentEnvError):
    """The session is closed, or its shell ended while a command ran (the next `run()` opens a new one)."""


class _UntilMarker:
    """One output stream of one command: kept up to the cap, until the line that starts with `marker`."""

    def __init__(self, limit: int, marker: bytes) -> None:
        self.out = CappedOutput(limit)
        self._marker = b"\n" + marker
        self._held = b""          # the last bytes, which could be the start of the marker
        self._after: bytes | None = None

    def add(self, payload: bytes) -> None:
        if self._after is not None:
            self._after += payload
            return
        data = self._held + payload
        i = data.find(self._marker)
        if i >= 0:
            self.out.add(data[:i])
            self._after, self._held = data[i + len(self._marker):], b""
            return
        cut = max(len(data) - len(self._marker) + 1, 0)
        self.out.add(data[:cut])
        self._held = data[cut:]

    def cut_short(self) -> None:
        """No marker will come (the command was killed): what was held back is output too."""
        self.out.add(self._held)
        self._held = b""

    @property
    def done(self) -> bool:
        return self._after is not None and b"\n" in self._after

    def status(self) -> int:
        """The number after the marker on its line (stdout's carries the exit code)."""
        return int((self._after or b"").split(b"\n", 1)[0].strip() or KILLED_EXIT_CODE)


def _printf_format(data: bytes) -> str:
    """`data` as a single-quoted printf format that prints exactly those bytes (NULs included)."""
    out = []
    for b in data:
        c = chr(b)
        if c == "%":
            out.append("%%")
        elif 0x20 <= b < 0x7F and c not in "\\'":
            out.append(c)
        else:
            out.append(f"\\{b:03o}")
    return "'" + "".join(out) + "'"


@contextlib.contextmanager
def _docker_calls(sandbox: Sandbox) -> Iterator[None]:
    """Docker API errors as AgentENV errors: a daemon that does not answer, a container that is gone."""
    try:
        yield
    except (requests.exceptions.ConnectionError, ConnectionRefusedError) as e:
        docker_client.reset()
        raise docker_client.unavailable(e) from None
    except docker.errors.APIError as e:
        if isinstance(e, docker.errors.NotFound) or e.status_code == 409:
            raise sandbox._container_lost(str(e.explanation or e).splitlines()[0]) from None
        raise AgentEnvError(f"docker exec failed: {str(e.explanation or e).splitlines()[0]}") from None


class Session:
    """A persistent shell in one sandbox (see the module docstring). Open it with `Sandbox.session()`.

    `run()` calls are serialised (one command at a time per session); use one session per thread for
    parallel commands. `opens` counts the shells started, `reopened` says whether the last `run()` had to
    start one (after a pause, a fork, a host-side kill or an exited shell).
    """

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.opens = 0
        self.reopened = False
        self._stream: ExecStream | None = None
        self._exec_id = ""
        self._owner = 0          # the pid that opened the shell: a forked child opens its own
        self._closed = False
        self._lock = threading.Lock()
        with self._lock:
            self._open()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.opens} shell(s) opened"
        return f"Session(sandbox={self.sandbox.id!r}, {state})"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, cmd: str | Sequence[str], timeout: float | None = None,
            stdin: bytes | str | None = None) -> ExecResult:
        """Run `cmd` like `Sandbox.exec` does (a string under `sh -c`, a list as argv; the sandbox user,
        the work dir), with the same result and guarantees: separate capped outputs, `timed_out` once
        `timeout` (default: the config's exec_timeout_s) killed the command's whole process group."""
        argv = _argv(cmd)
        cfg = self.sandbox.config
        timeout_s = _positive(timeout, cfg.exec_timeout_s, "timeout")
        data = _stdin_bytes(stdin)
        with self._lock:
            if self._closed:
                raise SessionError(f"this session of sandbox {self.sandbox.id} is closed; open a new one "
                                   "with sandbox.session()")
            self.reopened = not self._usable()
            if self.reopened:
                self._open()
            raw = self._run(argv, timeout_s, cfg.output_limit_bytes, data)
        result = self.sandbox._exec_result(raw)
        if result.oom_killed:
            self._drop()  # the sandbox is now broken: the next run() refuses, as exec does
        return result

    def close(self) -> None:
        """End the shell (closing the connection closes its stdin); idempotent."""
        with self._lock:
            self._closed = True
            self._drop()

    # ---- internals --------------------------------------------------------------------------------
    def _open(self) -> None:
        self._drop()
        rec = self.sandbox._record()
        if rec.state != "running":
            raise _state_error(rec, "run commands in")
        with _docker_calls(self.sandbox):
            self._exec_id, self._stream = start_exec(docker_client.api(), rec.container or "", SESSION_ARGV,
                                                     user=UIDS[rec.user], stdin=True)
        self._owner = os.getpid()
        self.opens += 1

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._stream = None

    def _usable(self) -> bool:
        """Is the current shell this process's and alive? Drops stray output of earlier background jobs."""
        stream = self._stream
        if stream is None or self._owner != os.getpid():
            self._stream = None  # a forked child's copy: the parent's connection stays the parent's
            return False
        deadline = time.monotonic() + _DRAIN_S
        try:
            while stream.ready() and time.monotonic() < deadline:
                if stream.read_frame(deadline) is None:
                    return False
        except TimeoutError:
            pass  # a frame still arriving: the rest is read as (stray) output of the next command
        except OSError:
            return False
        return True

    def _run(self, argv: list[str], timeout_s: float, limit: int, data: bytes | None) -> RawExec:
        stream = self._stream
        assert stream is not None
        marker = f"__agentenv_end_{secrets.token_hex(8)}__"
        command = " ".join(shlex.quote(a) for a in timeout_argv(argv, timeout_s))
        command = f"printf {_printf_format(data)} | {command}" if data else f"{command} </dev/null"
        line = f"{command}; printf '\\n{marker} %d\\n' $?; printf '\\n{marker}\\n' >&2\n"
        outs = (_UntilMarker(limit, marker.encode()), _UntilMarker(limit, marker.encode()))
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s + KILL_GRACE_S + HOST_GRACE_S
        try:
            stream.send(line.encode())
            while not (outs[0].done and outs[1].done):
                frame = stream.read_frame(deadline)
                if frame is None:
                    raise ConnectionResetError("the stream ended")
                kind, payload = frame
                if kind in (1, 2):
                    outs[kind - 1].add(payload)
        except TimeoutError:
            # `timeout` did not end the command in time: kill what hangs on the shell's pipes, shell included.
            pid = exec_pid(docker_client.api(), self._exec_id)
            if pid > 0:
                kill_attached([pid])
            self._drop()
            for o in outs:
                o.cut_short()
            return self._raw(outs, KILLED_EXIT_CODE, time.perf_counter() - t0, timed_out=True)
        except OSError:
            self._drop()
            raise self.sandbox._container_lost(
                f"the session's shell ended while running {shlex.join(argv)[:80]!r}") from None
        duration = time.perf_counter() - t0
        code = outs[0].status()
        return self._raw(outs, code, duration, timed_out=is_timeout(code, duration, timeout_s))

    @staticmethod
    def _raw(outs: tuple[_UntilMarker, _UntilMarker], code: int, duration: float, timed_out: bool) -> RawExec:
        return RawExec(code, bytes(outs[0].out.data), bytes(outs[1].out.data), duration, timed_out,
                       outs[0].out.truncated or outs[1].out.truncated)


def end_sessions(container: str) -> int:
    """End every session shell running in `container`, whichever process opened it, with everything
    still attached to its pipes; returns how many. `Sandbox.pause` calls it before the checkpoint."""
    api = docker_client.api()
    try:
        exec_ids = api.inspect_container(container).get("ExecIDs") or []
    except docker.errors.NotFound:
        return 0
    pids = []
    for exec_id in exec_ids:
        try:
            info = api.exec_inspect(exec_id)
        except docker.errors.NotFound:
            continue  # it ended meanwhile
        pc = info.get("ProcessConfig") or {}
        if info.get("Running") and (pc.get("entrypoint"), *(pc.get("arguments") or ())) == SESSION_ARGV:
            pids.append(int(info.get("Pid") or 0))
    pids = [p for p in pids if p > 0]
    if pids:
        kill_attached(pids)
    return len(pids)
