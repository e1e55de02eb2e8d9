"""Filesystem operations for envd's `filesystem.Filesystem` (stat, list, mkdir, move, remove), each one
`Sandbox.exec` of a small script confined to the sandbox's work dir exactly like `Sandbox.write_file`
(same path normalisation and the same symlink-resolving check), reporting entries with GNU find.

`home_dir` is the one place that says which directory E2B's "user home" is in a sandbox: where commands
start when no `cwd` is given and what relative paths (of files and of `cwd`) are resolved against."""

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
# type, target type, size, mode (octal), permissions, owner, group, mtime, path; each entry is then
# followed by its symlink target (resolved by realpath, as envd reports it) or nothing, NUL-terminated
_FORMAT = r"%y\t%Y\t%s\t%m\t%M\t%u\t%g\t%T@\t%p\0"
_PRINT = (rf"\( -type l -printf '{_FORMAT}' \( -exec realpath -m -z -- {{}} \; -o -printf '\0' \) \) "
          rf"-o -printf '{_FORMAT}\0'")
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


def home_dir(sb: Sandbox) -> str:
    """The sandbox's default working directory, E2B's user home: commands start there and relative paths
    are resolved against it. Today the sandbox's work dir (`config.workspace`, `/workspace`)."""
    return sb.config.workspace.rstrip("/") or "/"


def resolve(sb: Sandbox, path: str) -> str:
    """`path` made absolute (a relative one is taken from `home_dir`) and normalised; no confinement."""
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home_dir(sb), path))


def sandbox_path(sb: Sandbox, path: str) -> str:
    """The absolute path in the sandbox (relative paths are relative to `home_dir`), or refused when it
    leaves the work dir."""
    ws = sb.config.workspace.rstrip("/")
    if isinstance(path, str) and path and "\0" not in path:
        full = resolve(sb, path)
        if full == ws or full.startswith(ws + "/"):
            return full
        raise PathOutsideWorkspace(f"path {path!r} is outside the sandbox work dir {ws}; give a path "
                                   f"relative to {home_dir(sb)} or below {ws}/")
    return workspace_path(path, ws)  # refuses it, saying why


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
    """Entries of `find ... _PRINT` output: pairs of NUL-terminated (fields and path, symlink target)."""
    out = []
    parts = stdout.split("\0")
    for rec, link in zip(parts[0::2], parts[1::2], strict=False):
        f = rec.split("\t", 8)
        if len(f) != 9:
            continue
        ftype, target, size, mode, perms, owner, group, mtime, path = f
        kind = ftype if ftype != "l" else target
        out.append(Entry(name=posixpath.basename(path.rstrip("/")) or path,
                         type={"f": "file", "d": "dir"}.get(kind, "other"), is_symlink=ftype == "l",
                         path=path, size=int(size), mode=int(mode, 8), permissions=perms, owner=owner,
                         group=group, mtime=float(mtime), symlink_target=link or None))
    return out


def stat(sb: Sandbox, path: str) -> Entry:
    full = sandbox_path(sb, path)
    r = _run(sb, _confined(sb) + _exists() + f'exec find "$p" -maxdepth 0 {_PRINT}', full,
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
             f'exec find "$p" -mindepth 1 -maxdepth {depth} {_PRINT}', full,
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
    """Remove a file or a directory tree; a path with nothing there is fine (envd's remove succeeds)."""
    full = sandbox_path(sb, path)
    if full == sb.config.workspace.rstrip("/"):
        raise PathOutsideWorkspace(f"refusing to remove the work dir {full} itself")
    _run(sb, _confined(sb) + 'rm -rf -- "$p"', full, what=f"remove {path!r}")
