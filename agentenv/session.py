"""`Session`: a persistent shell in a running sandbox, so that many small commands avoid one exec each
(an exec costs three Docker API calls and a runc exec; a command written to a running shell, a fork and
an execve). `run()` keeps exec's result and guarantees: separate capped outputs, a timeout that kills the
command's process group, nothing carried over between commands. A pause or fork of the sandbox ends its
shells; the next `run()` opens a new one (`reopened`). How it works: docs/agentenv.md, "Sessions".
"""

from __future__ import annotations

import os
import secrets
import shlex
import threading
import time
from collections.abc import Callable, Sequence

from agentenv import checks
from agentenv.backend.base import SHELL_ARGV, RawExec, ShellStream
from agentenv.backend.commands import HOST_GRACE_S, KILL_GRACE_S, CappedOutput, is_timeout, timeout_argv
from agentenv.config import SandboxConfig
from agentenv.errors import AgentEnvError, SessionError
from agentenv.results import ExecResult

__all__ = ["SESSION_ARGV", "Session", "SessionError"]

SESSION_ARGV = SHELL_ARGV  # the shell's argv (`$4` only labels the process)
KILLED_EXIT_CODE = 137   # reported when the host had to kill the command (128 + SIGKILL)
_DRAIN_S = 0.05          # at most this long spent dropping stray output before a command


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


class Session:
    """A persistent shell in one sandbox. Open it with `Sandbox.session()`, which passes what the session
    needs of its sandbox: `open_shell()` (a new shell, or the sandbox's state error), `finish(raw)` (the
    decoded result, after an OOM check) and `lost(detail)` (after the shell ended during a command: None
    while the sandbox still runs, else the error saying why it is gone).

    Something inside a running sandbox can end the shell during a command: the command itself
    (`kill -9 -1`, `pkill sh`), a job it left behind, or the pids limit (a shell that cannot fork exits).
    That command's result is then what it printed and the shell's exit status (137 after a SIGKILL), and
    the next `run()` opens a new shell (`reopened`): the session never fails because of a command.

    `run()` calls are serialised (one command at a time per session); use one session per thread for
    parallel commands. `opens` counts the shells started, `reopened` says whether the last `run()` had to
    start one (after a pause, a fork, a host-side kill or an exited shell).
    """

    def __init__(self, sandbox_id: str, config: SandboxConfig, open_shell: Callable[[], ShellStream],
                 finish: Callable[[RawExec], ExecResult],
                 lost: Callable[[str], AgentEnvError | None]) -> None:
        self.sandbox_id = sandbox_id
        self.config = config
        self._open_shell = open_shell
        self._finish = finish
        self._lost = lost
        self.opens = 0
        self.reopened = False
        self._stream: ShellStream | None = None
        self._owner = 0          # the pid that opened the shell: a forked child opens its own
        self._closed = False
        self._lock = threading.Lock()
        with self._lock:
            self._open()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.opens} shell(s) opened"
        return f"Session(sandbox={self.sandbox_id!r}, {state})"

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
        argv = checks.command_argv(cmd)
        timeout_s = checks.timeout_seconds(timeout, self.config.exec_timeout_s)
        data = checks.stdin_bytes(stdin)
        with self._lock:
            if self._closed:
                raise SessionError(f"this session of sandbox {self.sandbox_id} is closed; open a new one "
                                   "with sandbox.session()")
            self.reopened = not self._usable()
            if self.reopened:
                self._open()
            raw = self._run(argv, timeout_s, self.config.output_limit_bytes, data)
        result = self._finish(raw)
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
        self._stream = self._open_shell()
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
            stream.kill()
            self._drop()
            for o in outs:
                o.cut_short()
            return self._raw(outs, KILLED_EXIT_CODE, time.perf_counter() - t0, timed_out=True)
        except OSError:
            code = stream.exit_code()
            self._drop()
            error = self._lost(f"the session's shell ended while running {shlex.join(argv)[:80]!r}")
            if error is not None:
                raise error from None
            # the sandbox runs on: something in it ended the shell (see the class docstring)
            for o in outs:
                o.cut_short()
            return self._raw(outs, code if code > 0 else KILLED_EXIT_CODE, time.perf_counter() - t0,
                             timed_out=False)
        duration = time.perf_counter() - t0
        code = outs[0].status()
        return self._raw(outs, code, duration, timed_out=is_timeout(code, duration, timeout_s))

    @staticmethod
    def _raw(outs: tuple[_UntilMarker, _UntilMarker], code: int, duration: float, timed_out: bool) -> RawExec:
        return RawExec(code, bytes(outs[0].out.data), bytes(outs[1].out.data), duration, timed_out,
                       outs[0].out.truncated or outs[1].out.truncated)
