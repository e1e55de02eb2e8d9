"""The host's side of the guest agent (`guest/agent.py` documents the frames and requests): a VM's agent
ports are QEMU's unix sockets `ch<n>.sock`, each taken by one holder at a time with `flock` on
`ch<n>.lock` (any thread or process; a dead holder's lock and connection go with it, and the agent then
kills what the holder's request left running). `exec` runs one command with AgentENV's guarantees, and
`AgentShell` is a session's shell (`SandboxBackend.open_shell`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import secrets
import select
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentenv.backend.base import ContainerNotRunning, RawExec, ShellStream
from agentenv.backend.commands import HOST_GRACE_S, KILL_GRACE_S, CappedOutput
from agentenv.backend.microvm.qemu import channel_socket, running_pid
from agentenv.errors import AgentEnvError, SandboxBusy

HEADER = struct.Struct(">IB")
# a connection's first line and its answer (guest/agent.py)
HELLO, WELCOME = b"\x00\xffAGENTENV-HELLO ", b"\x00\xffAGENTENV-WELCOME "
STDIN, STDOUT, STDERR, JSON = 0, 1, 2, 3
CHUNK = 64 * 1024
WAIT_FOR_CHANNEL_S = 60.0
# Past a command's own deadline and grace periods: the guest's slack (TCG is slow) before the host gives up.
GUEST_SLACK_S = 15.0


class AgentError(AgentEnvError):
    """The guest agent answered a request with an error (`code` is its errno name)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Channel:
    """One agent port of a running VM, held by this object until `close`."""

    def __init__(self, vm_dir: Path, channels: int, wait_s: float = WAIT_FOR_CHANNEL_S) -> None:
        self.vm_dir = vm_dir
        self._buf = bytearray()
        self.eof = False
        deadline = time.monotonic() + wait_s
        order = list(range(channels))
        random.shuffle(order)
        delay = 0.002
        while True:
            if running_pid(vm_dir) is None:
                raise ContainerNotRunning(f"its VM does not run (no QEMU for {vm_dir})")
            for i in order:
                if self._take(i):
                    return
            if time.monotonic() > deadline:
                raise SandboxBusy(f"all {channels} agent channels of the VM in {vm_dir} stayed in use for "
                                  f"{wait_s:g} s (sessions and commands in flight); retry later")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _take(self, i: int) -> bool:
        fd = os.open(self.vm_dir / f"ch{i}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(channel_socket(self.vm_dir, i)))
        except OSError as e:
            sock.close()
            os.close(fd)
            raise ContainerNotRunning(f"its VM's agent channel {i} does not answer ({e})") from None
        self.index, self.sock, self._lock_fd = i, sock, fd
        self._nonce = secrets.token_hex(8).encode()
        try:
            sock.sendall(HELLO + self._nonce + b"\n")
        except OSError as e:
            self.close()
            raise ContainerNotRunning(f"its VM's agent channel {i} does not answer ({e})") from None
        self._synced = False
        return True

    def _sync(self, deadline: float) -> None:
        """Skip what an earlier connection left in flight, up to the agent's answer to this hello."""
        welcome = WELCOME + self._nonce + b"\n"
        while (i := self._buf.find(welcome)) < 0:
            del self._buf[:max(0, len(self._buf) - len(welcome))]
            if not self._recv(deadline):
                return
        del self._buf[:i + len(welcome)]
        self._synced = True

    def _recv(self, deadline: float) -> bool:
        """Read what the socket has (waiting until `deadline`); False at the end of the connection."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer from the guest agent before the deadline")
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(256 * 1024)
        except TimeoutError:
            raise TimeoutError("no answer from the guest agent before the deadline") from None
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return False
        self._buf += data
        return True

    # ---- frames -----------------------------------------------------------------------------------------
    def send(self, kind: int, payload: bytes = b"") -> None:
        try:
            self.sock.settimeout(None)
            self.sock.sendall(HEADER.pack(len(payload), kind) + payload)
        except OSError as e:
            raise ConnectionResetError(f"the agent channel closed: {e}") from None

    def send_json(self, obj: Mapping[str, Any]) -> None:
        self.send(JSON, json.dumps(obj).encode())

    def send_input(self, data: bytes | None) -> None:
        """`data` as stdin frames, then the end of input."""
        view = memoryview(data or b"")
        for i in range(0, len(view), CHUNK):
            self.send(STDIN, bytes(view[i:i + CHUNK]))
        self.send(STDIN, b"")

    def _frame(self) -> tuple[int, bytes] | None:
        if len(self._buf) < HEADER.size:
            return None
        size, kind = HEADER.unpack_from(self._buf)
        if len(self._buf) < HEADER.size + size:
            return None
        payload = bytes(self._buf[HEADER.size:HEADER.size + size])
        del self._buf[:HEADER.size + size]
        return kind, payload

    def read_frame(self, deadline: float) -> tuple[int, bytes] | None:
        """The next (kind, payload), None once the connection ended; TimeoutError after `deadline`
        (time.monotonic) with the frame incomplete (the channel stays usable)."""
        if not self._synced and not self.eof:
            self._sync(deadline)
        while (f := self._frame()) is None:
            if self.eof or not self._recv(deadline):
                return None
        return f

    def ready(self) -> bool:
        if (self._synced and self._frame_complete()) or self.eof:
            return True
        return bool(select.select([self.sock], [], [], 0)[0])

    def _frame_complete(self) -> bool:
        if len(self._buf) < HEADER.size:
            return False
        return len(self._buf) >= HEADER.size + HEADER.unpack_from(self._buf)[0]

    def answer(self, deadline: float) -> dict[str, Any]:
        """The next JSON frame (frames of other kinds before it are dropped); AgentError for an error."""
        while True:
            f = self.read_frame(deadline)
            if f is None:
                raise ConnectionResetError("the agent channel closed before the answer")
            if f[0] == JSON:
                obj = json.loads(f[1])
                if "error" in obj:
                    raise AgentError(obj["error"], obj.get("message", obj["error"]))
                return obj

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def _lost(vm_dir: Path, e: Exception) -> ContainerNotRunning | None:
    """A broken channel: ContainerNotRunning when the VM itself is gone, else None (the caller decides)."""
    if running_pid(vm_dir) is None:
        return ContainerNotRunning(f"its VM stopped ({e})")
    return None


def request(vm_dir: Path, channels: int, obj: Mapping[str, Any], *, stdin: bytes | None = None,
            timeout_s: float = 60.0) -> tuple[dict[str, Any], bytes]:
    """One request: its answer and the stdout frames that came before it."""
    ch = Channel(vm_dir, channels)
    out = bytearray()
    try:
        deadline = time.monotonic() + timeout_s
        ch.send_json(obj)
        if stdin is not None:
            ch.send_input(stdin)
        while True:
            f = ch.read_frame(deadline)
            if f is None:
                raise ConnectionResetError("the agent channel closed before the answer")
            if f[0] == STDOUT:
                out += f[1]
            elif f[0] == JSON:
                answer = json.loads(f[1])
                if "error" in answer:
                    raise AgentError(answer["error"], answer.get("message", answer["error"]))
                return answer, bytes(out)
    except (ConnectionResetError, TimeoutError) as e:
        raise _lost(vm_dir, e) or AgentEnvError(f"the guest agent of {vm_dir.name} did not answer "
                                                f"{obj.get('op')!r}: {e}") from None
    finally:
        ch.close()


def exec_command(vm_dir: Path, channels: int, argv: Sequence[str], *, uid: int, gid: int, timeout_s: float,
                 output_limit: int, stdin: bytes | None = None, env: Mapping[str, str] | None = None,
                 workdir: str | None = None) -> RawExec:
    """Run argv in the guest with exec's guarantees (`agentenv.backend.commands`): its process group is
    TERMed at the deadline and KILLed 2 s later, outputs capped. Should the guest not answer in time, the
    host drops the channel, which makes the agent kill the command and what holds its pipes."""
    t0 = time.perf_counter()
    ch = Channel(vm_dir, channels)
    outs = (CappedOutput(output_limit), CappedOutput(output_limit))
    try:
        ch.send_json({"op": "exec", "argv": list(argv), "uid": uid, "gid": gid, "timeout_s": timeout_s,
                      "output_limit": output_limit, "stdin": stdin is not None, "env": dict(env or {}),
                      "cwd": workdir})
        if stdin is not None:
            ch.send_input(stdin)
        deadline = time.monotonic() + timeout_s + KILL_GRACE_S + HOST_GRACE_S + GUEST_SLACK_S
        while True:
            f = ch.read_frame(deadline)
            if f is None:
                raise ConnectionResetError("the agent channel closed during the command")
            kind, payload = f
            if kind in (STDOUT, STDERR):
                outs[kind - 1].add(payload)
            elif kind == JSON:
                res = json.loads(payload)
                if "error" in res:
                    raise AgentError(res["error"], res.get("message", ""))
                return RawExec(int(res["exit_code"]), bytes(outs[0].data), bytes(outs[1].data),
                               time.perf_counter() - t0, bool(res["timed_out"]),
                               bool(res["truncated"]) or outs[0].truncated or outs[1].truncated)
    except TimeoutError:
        return RawExec(137, bytes(outs[0].data), bytes(outs[1].data), time.perf_counter() - t0, True,
                       outs[0].truncated or outs[1].truncated)
    except ConnectionResetError as e:
        raise _lost(vm_dir, e) or ContainerNotRunning(f"its VM's agent dropped the command ({e})") from None
    finally:
        ch.close()


class AgentShell(ShellStream):
    """A session's shell (`sh -s`) in the guest, on an agent channel of its own."""

    def __init__(self, vm_dir: Path, channels: int, *, uid: int, gid: int) -> None:
        self.vm_dir = vm_dir
        self._ch = Channel(vm_dir, channels)
        self._exit: int | None = None
        try:
            self._ch.send_json({"op": "shell", "uid": uid, "gid": gid})
            self._ch.answer(time.monotonic() + 60.0)
        except (ConnectionResetError, TimeoutError, AgentError) as e:
            self._ch.close()
            raise _lost(vm_dir, e) or ContainerNotRunning(f"the guest agent started no shell: {e}") from None

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            self._ch.send(STDIN, bytes(view[i:i + CHUNK]))

    def read_frame(self, deadline: float) -> tuple[int, bytes] | None:
        while True:
            f = self._ch.read_frame(deadline)
            if f is None:
                return None
            kind, payload = f
            if kind in (STDOUT, STDERR):
                return kind, payload
            if kind == JSON:
                self._exit = int(json.loads(payload).get("exit_code", -1))
                self._ch.eof = True
                return None

    def ready(self) -> bool:
        return self._ch.ready()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self._ch.send_json({"op": "kill"})

    def exit_code(self) -> int:
        return -1 if self._exit is None else self._exit

    def close(self) -> None:
        self._ch.close()
