"""`AgentFiles`: a running microVM sandbox's files for the host (`SandboxBackend.live_files`), through the
guest agent's file requests, which it serves with the sandbox user's file rights (a host request can do no
more than the sandbox's own processes)."""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentenv.backend.base import LiveFiles
from agentenv.backend.microvm.channel import AgentError, request

_ERRORS = {"ENOENT": FileNotFoundError, "ENOTDIR": NotADirectoryError, "ENXIO": ConnectionRefusedError,
           "EPIPE": BrokenPipeError, "ETIMEDOUT": TimeoutError, "EACCES": PermissionError,
           "EPERM": PermissionError, "ELOOP": PermissionError}


def _os_error(e: AgentError) -> OSError:
    kind = _ERRORS.get(e.code, OSError)
    return kind(getattr(errno, e.code, errno.EIO), str(e))


class AgentFiles(LiveFiles):
    def __init__(self, vm_dir: Path, channels: int) -> None:
        self.vm_dir, self.channels = vm_dir, channels

    def _call(self, obj: Mapping, stdin: bytes | None = None, timeout_s: float = 60.0) -> tuple[dict, bytes]:
        try:
            return request(self.vm_dir, self.channels, obj, stdin=stdin, timeout_s=timeout_s)
        except AgentError as e:
            raise _os_error(e) from None

    def read_many(self, offsets: Mapping[str, int], limit: int) -> dict[str, tuple[int, bytes] | None]:
        answer, data = self._call({"op": "read_many", "offsets": dict(offsets), "limit": limit})
        out: dict[str, tuple[int, bytes] | None] = {}
        pos = 0
        for path in offsets:
            got = answer["files"].get(path)
            if got is None:
                out[path] = None
                continue
            size, n = got
            out[path] = (int(size), data[pos:pos + n])
            pos += n
        return out

    def write(self, path: str, data: bytes) -> None:
        self._call({"op": "write", "path": path}, stdin=data)

    def listdir(self, path: str) -> list[str]:
        return list(self._call({"op": "listdir", "path": path})[0]["names"])

    def write_fifo(self, path: str, data: bytes, timeout_s: float) -> None:
        self._call({"op": "write", "path": path, "fifo": True, "timeout_s": timeout_s}, stdin=data,
                   timeout_s=timeout_s + 30.0)

    def start_detached(self, base: str, tag: str, argv: Sequence[str], env: Mapping[str, str], cwd: str,
                       stdin: bool) -> int | None:
        """The guest agent's own launcher (no shell, no wrapper process: each costs a fork and an exec,
        which are dear in an emulated guest)."""
        return int(self._call({"op": "launch", "base": base, "tag": tag, "argv": list(argv), "env": dict(env),
                               "cwd": cwd, "stdin": stdin})[0]["pid"])

    def tree_usage(self, path: str) -> tuple[int, int]:
        answer = self._call({"op": "tree_usage", "path": path})[0]
        return int(answer["bytes"]), int(answer["total"])
