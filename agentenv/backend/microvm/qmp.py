"""A QEMU Machine Protocol client: one JSON command per line over the VM's unix socket, file descriptors
passed with SCM_RIGHTS (`getfd`), asynchronous events skipped. Every call has a deadline."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from agentenv.errors import AgentEnvError


class QmpError(AgentEnvError):
    """QEMU refused a command, or its monitor went away."""


class Qmp:
    def __init__(self, path: Path, timeout_s: float = 30.0) -> None:
        self.path = path
        deadline = time.monotonic() + timeout_s
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise QmpError(f"QEMU's monitor {path} does not answer: {e}") from None
                time.sleep(0.002)
        self.sock.settimeout(timeout_s)
        self._buf = b""
        self._line()  # the greeting
        self.call("qmp_capabilities")

    def _line(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            try:
                data = self.sock.recv(65536)
            except OSError as e:
                raise QmpError(f"QEMU's monitor {self.path} failed: {e}") from None
            if not data:
                raise QmpError(f"QEMU's monitor {self.path} closed (QEMU exited)")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, command: str, fds: list[int] | None = None, **arguments: Any) -> Any:
        """The command's `return` value; QmpError with QEMU's message when it failed."""
        msg = {"execute": command, **({"arguments": arguments} if arguments else {})}
        data = json.dumps(msg).encode() + b"\n"
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.sendall(data)
        except OSError as e:
            raise QmpError(f"QEMU's monitor {self.path} failed: {e}") from None
        while True:
            reply = self._line()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise QmpError(f"QEMU refused {command}: {reply['error'].get('desc', reply['error'])}")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> Qmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
