"""Filesystem operations for envd's `filesystem.Filesystem` (stat, list, mkdir, move, remove), each one
`Sandbox.exec` of a small script confined to the sandbox's work dir exactly like `Sandbox.write_file`
(same path normalisation and the same symlink-resolving check), reporting entries with GNU find."""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

from agentenv.checks import workspace_path
from agentenv.errors import (
    AgentEnvError,
    FileExistsInSandbox,
    FileNotFoundInSandbox,
    InvalidArgument,
    NotADirectoryInSandbox,
    PathOutsideWorkspace,
)
from agentenv.sandbox import _EXIT_REFUSED, Sandbox, _confine

_EXIT_MISSING = 5
_EXIT_EXISTS = 6
_EXIT_NOT_DIR = 7
# type, target type, size, mode (octal), permissions, owner, group, mtime, link target, path
_FORMAT = r"%y\t%Y\t%s\t%m\t%M\t%u\t%g\t%T@\t%l\t%p\0"
_MAX_DEPTH = 16
_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Entry:
    name: str
    type: str            # 'file' | 'dir' | 'other'
    is_symlink: bool
    path: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    mtime: float
    symlink_target: str | None


def sandbox_path(sb: Sandbox, path: str) -> str:
    """The absolute path in the sandbox (relative paths are relative to the work dir), or refused."""
    ws = sb.config.workspace.rstrip("/")
    if isinstance(path, str) and path and "\0" not in path:
        full = posixpath.normpath(path if path.startswith("/") else posixpath.join(ws, path))
        if full == ws:
            return ws
    return workspace_path(path, ws)


def _run(sb: Sandbox, script: str, *args: str, what: str):
    r = sb.exec(["sh", "-c", script, "sh", *args], timeout=_TIMEOUT_S)
    msg = (r.stderr or "").strip()
    if r.exit_code == 0:
        return r
    if r.exit_code == _EXIT_REFUSED:
        raise PathOutsideWorkspace(f"{what} refused: {msg}")
    if r.exit_code == _EXIT_MISSING:
        raise FileNotFoundInSandbox(f"{what}: no such file or directory: {args[0]}")
    if r.exit_code == _EXIT_EXISTS:
        raise FileExistsInSandbox(f"{what}: {args[-1]} exists already")
    if r.exit_code == _EXIT_NOT_DIR:
        raise NotADirectoryInSandbox(f"{what}: {args[0]} is not a directory")
    raise AgentEnvError(f"{what} failed in sandbox {sb.id}: {msg or f'exit {r.exit_code}'}")


def _confined(sb: Sandbox) -> str:
    """Like `_confine`, but the work dir itself is allowed too (listing it is the common case)."""
    ws = sb.config.workspace.rstrip("/")
    return f'if [ "$1" = {shlex.quote(ws)} ]; then p=$1; else ' + _confine(ws).rstrip("; ") + "; fi; "


def _exists(var: str = "p") -> str:
    return f'{{ [ -e "${var}" ] || [ -L "${var}" ]; }} || exit {_EXIT_MISSING}; '


def _entries(stdout: str) -> list[Entry]:
    out = []
    for rec in stdout.split("\0"):
        if not rec:
            continue
        f = rec.split("\t", 9)
        if len(f) != 10:
            continue
        ftype, target, size, mode, perms, owner, group, mtime, link, path = f
        kind = ftype if ftype != "l" else target
        out.append(Entry(name=posixpath.basename(path.rstrip("/")) or path,
                         type={"f": "file", "d": "dir"}.get(kind, "other"), is_symlink=ftype == "l",
                         path=path, size=int(size), mode=int(mode, 8), permissions=perms, owner=owner,
                         group=group, mtime=float(mtime), symlink_target=link or None))
    return out


def stat(sb: Sandbox, path: str) -> Entry:
    full = sandbox_path(sb, path)
    r = _run(sb, _confined(sb) + _exists() + f'exec find "$p" -maxdepth 0 -printf \'{_FORMAT}\'', full,
             what=f"stat {path!r}")
    entries = _entries(r.stdout)
    if not entries:
        raise FileNotFoundInSandbox(f"stat {path!r}: no such file or directory")
    return entries[0]


def list_dir(sb: Sandbox, path: str, depth: int) -> list[Entry]:
    if not 1 <= depth <= _MAX_DEPTH:
        raise InvalidArgument(f"depth must be from 1 to {_MAX_DEPTH}, got {depth}")
    full = sandbox_path(sb, path)
    r = _run(sb, _confined(sb) + _exists() + f'[ -d "$p" ] || exit {_EXIT_NOT_DIR}; '
             f'exec find "$p" -mindepth 1 -maxdepth {depth} -printf \'{_FORMAT}\'', full,
             what=f"list {path!r}")
    return sorted(_entries(r.stdout), key=lambda e: e.path)


def make_dir(sb: Sandbox, path: str) -> Entry:
    full = sandbox_path(sb, path)
    _run(sb, _confined(sb) + f'{{ [ -e "$p" ] || [ -L "$p" ]; }} && exit {_EXIT_EXISTS}; mkdir -p -- "$p"',
         full, what=f"make dir {path!r}")
    return stat(sb, full)


def move(sb: Sandbox, source: str, destination: str) -> Entry:
    src, dst = sandbox_path(sb, source), sandbox_path(sb, destination)
    _run(sb, _confined(sb) + _exists() + 's=$p; shift; ' + _confined(sb) + 'mv -T -- "$s" "$p"', src, dst,
         what=f"move {source!r} to {destination!r}")
    return stat(sb, dst)


def remove(sb: Sandbox, path: str) -> None:
    full = sandbox_path(sb, path)
    if full == sb.config.workspace.rstrip("/"):
        raise PathOutsideWorkspace(f"refusing to remove the work dir {full} itself")
    _run(sb, _confined(sb) + _exists() + 'rm -rf -- "$p"', full, what=f"remove {path!r}")
