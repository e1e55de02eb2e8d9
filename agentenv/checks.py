"""The argument checks of every sandbox handle and shell session (local, pooled, remote): one place, so a
bad argument gets the same `InvalidArgument` (or `PathOutsideWorkspace`), with a message naming it,
whichever kind of sandbox the caller holds. Each check returns the value in the form the caller sends on.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from agentenv.errors import InvalidArgument, PathOutsideWorkspace

MAX_FORKS = 64  # forks one `fork(n)` makes at most
_SHELL_BLANKS = " \t\n"  # what `sh` skips between words: a line of only these runs nothing


def command_argv(cmd: str | Sequence[str]) -> list[str]:
    """`cmd` as argv: a string runs under `sh -c`, a list is the argv itself."""
    if isinstance(cmd, str):
        if not cmd.strip(_SHELL_BLANKS):
            raise InvalidArgument("cmd is an empty command: give a shell command line or a non-empty argv "
                                  "list")
        argv = ["sh", "-c", cmd]
    elif isinstance(cmd, Sequence) and cmd and all(isinstance(a, str) for a in cmd):
        argv = list(cmd)
    else:
        raise InvalidArgument(f"cmd must be a string or a non-empty list of strings, got {cmd!r}")
    if not argv[0]:
        raise InvalidArgument("cmd: the program (argv[0]) is an empty string")
    if any("\0" in a for a in argv):
        raise InvalidArgument("cmd must not contain NUL bytes")
    for a in argv:
        _utf8(a, "cmd")
    return argv


def _utf8(text: str, what: str) -> bytes:
    """`text` as UTF-8; a lone surrogate (no UTF-8 form) is refused, naming where it is."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{what} is not valid Unicode text: {text[e.start]!r} at index {e.start} is a "
                              "lone surrogate, which has no UTF-8 form") from None


def timeout_seconds(timeout: float | None, default: float) -> float:
    """A command's timeout in seconds (`default` when None)."""
    if timeout is None:
        return float(default)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def stdin_bytes(stdin: bytes | bytearray | str | None) -> bytes | None:
    """A command's stdin as bytes (a str is UTF-8 encoded)."""
    if stdin is None or isinstance(stdin, bytes):
        return stdin
    if isinstance(stdin, str):
        return _utf8(stdin, "stdin")
    if isinstance(stdin, bytearray):
        return bytes(stdin)
    raise InvalidArgument(f"stdin must be bytes or str, got {type(stdin).__name__}")


def exec_env(env: Mapping[str, str] | None) -> dict[str, str] | None:
    """Extra environment variables of a command: names without '=' or NUL, str values without NUL."""
    if env is None:
        return None
    if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        raise InvalidArgument(f"env must map names (non-empty, without '=') to str values, got {env!r}")
    return dict(env)


def exec_workdir(workdir: str | None) -> str | None:
    """The directory a command starts in: an absolute path."""
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")
                                or "\0" in workdir):
        raise InvalidArgument(f"workdir must be an absolute path, got {workdir!r}")
    return workdir


def port_number(port: int) -> int:
    """A TCP port a sandbox's loopback listener may take: an int from 1 to 65535."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port must be an integer from 1 to 65535, got {port!r}")
    return port


def fork_count(n: int) -> int:
    """How many forks one call makes: an int from 1 to MAX_FORKS."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORKS:
        raise InvalidArgument(f"fork count must be an integer from 1 to {MAX_FORKS}, got {n!r}")
    return n


def sandbox_labels(labels: Mapping[str, Any] | None) -> dict[str, str] | None:
    """Labels of a sandbox: non-empty str keys; str, number or bool values (kept as str)."""
    if labels is None:
        return None
    if not isinstance(labels, Mapping):
        raise InvalidArgument(f"labels must be a mapping of names to values, got {labels!r}")
    out = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not key or "\0" in key:
            raise InvalidArgument(f"labels: a name must be a non-empty string, got {key!r}")
        if not isinstance(value, str | int | float | bool) or "\0" in str(value):
            raise InvalidArgument(f"labels[{key!r}] must be a string, got {value!r}")
        out[key] = str(value)
    return out


def workspace_path(path: str, workspace: str) -> str:
    """A file path as the absolute path below the work dir it names; any that leaves it (`..`, other
    absolute paths) is refused. Symlinks are resolved, and checked again, inside the sandbox."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise PathOutsideWorkspace(f"path {path!r} is invalid: give a file path under {workspace}")
    ws = workspace.rstrip("/")
    full = posixpath.normpath(path if path.startswith("/") else posixpath.join(ws, path))
    if not full.startswith(ws + "/"):
        raise PathOutsideWorkspace(f"path {path!r} is outside the sandbox work dir {ws}; "
                                   f"give a path relative to it or below {ws}/")
    return full


def file_payload(data: bytes | bytearray | str, limit: int) -> bytes:
    """A file's content as bytes (a str is UTF-8 encoded), at most `limit` (file_limit_bytes) long."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes | bytearray):
        raise InvalidArgument(f"data must be bytes or str, got {type(data).__name__}")
    if len(data) > limit:
        raise InvalidArgument(f"data: a file of {len(data)} bytes exceeds file_limit_bytes={limit}")
    return bytes(data)


def file_mode(mode: int) -> int:
    """A file's permission bits: an int like 0o644."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode must be an int permission like 0o644, got {mode!r}")
    return mode
