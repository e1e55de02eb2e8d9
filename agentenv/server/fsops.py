"""Filesystem operations for envd's `filesystem.Filesystem` and `/files` (stat, list, write, mkdir, move,
remove), each one `Sandbox.exec` confined to the sandbox's work dir exactly like `Sandbox.write_file` (same
path normalisation and the same symlink-resolving check); entries are described by `fs_scripts.DESCRIBE`.

`home_dir` is the one place that says which directory E2B's "user home" is in a sandbox: `/home/user`,
where commands start when no `cwd` is given and what relative paths (of files and of `cwd`) are resolved
against. The base image links it to the work dir (`/home/user -> /workspace`), so both names reach the same
files; a path is reported under the name it was asked by (relative paths under the home)."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

from agentenv import files
from agentenv.checks import workspace_path
from agentenv.errors import (
    AgentEnvError,
    FileNotFoundInSandbox,
    InvalidArgument,
    PathOutsideWorkspace,
)
from agentenv.files import EXIT_EXISTS, EXIT_MISSING
from agentenv.sandbox import Sandbox
from agentenv.server import fs_scripts

HOME = "/home/user"
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
    metadata: dict[str, str] = field(default_factory=dict)


def home_dir(sb: Sandbox) -> str:
    """The sandbox's default working directory, E2B's user home (`/home/user`, linked to the work dir by
    the base image): commands start there and relative paths are resolved against it."""
    return HOME


def _ws(sb: Sandbox) -> str:
    return sb.config.workspace.rstrip("/") or "/"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def resolve(sb: Sandbox, path: str) -> str:
    """`path` made absolute (a relative one is taken from `home_dir`) and normalised; no confinement."""
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home_dir(sb), path))


def sandbox_path(sb: Sandbox, path: str) -> str:
    """The absolute path in the sandbox as asked (relative paths are relative to `home_dir`), or refused
    when it leaves the work dir (under either of its names)."""
    ws = _ws(sb)
    if isinstance(path, str) and path and "\0" not in path:
        full = resolve(sb, path)
        if _under(full, ws) or _under(full, home_dir(sb)):
            return full
        raise PathOutsideWorkspace(f"path {path!r} is outside the sandbox work dir {home_dir(sb)} (also "
                                   f"named {ws}); give a path relative to {home_dir(sb)} or below it")
    return workspace_path(path, ws)  # refuses it, saying why


def physical(sb: Sandbox, full: str) -> str:
    """A confined absolute path under the work dir's own name (the home's prefix replaced)."""
    home = home_dir(sb)
    return _ws(sb) + full[len(home):] if _under(full, home) else full


def _shown(sb: Sandbox, path: str | None, as_home: bool) -> str | None:
    """A path the sandbox printed (work dir name) under the name the caller used."""
    ws = _ws(sb)
    if path is None or not as_home or not _under(path, ws):
        return path
    return home_dir(sb) + path[len(ws):]


def _run(sb: Sandbox, script: str, *args: str, what: str, env: dict[str, str] | None = None,
         stdin: bytes | None = None):
    r = sb.exec(["sh", "-c", script, "sh", *args], timeout=_TIMEOUT_S, env=env, stdin=stdin)
    error = files.file_error(r.exit_code, r.stderr or "", what=what, path=args[0], sandbox_id=sb.id)
    if error is not None:
        raise error
    return r


def _confined(sb: Sandbox) -> str:
    """`files.confine`, the work dir itself allowed too (listing it is the common case)."""
    return files.confine(_ws(sb), workdir_too=True)


def _exists(var: str = "p") -> str:
    return f'{{ [ -e "${var}" ] || [ -L "${var}" ]; }} || exit {EXIT_MISSING}; '


def _describe(sb: Sandbox, full: str, depth: int, what: str) -> list[Entry]:
    """Entries of `full` (depth 0: itself; else its contents to `depth` levels), named as `full` is."""
    as_home = _under(full, home_dir(sb))
    r = _run(sb, _confined(sb) + 'exec python3 -c "$PY" "$p" "$2"', physical(sb, full), str(depth),
             what=what, env={"PY": fs_scripts.DESCRIBE})
    return [_entry(sb, d, as_home) for d in _json(r.stdout, what)]


def _json(out: str, what: str) -> list[dict]:
    try:
        return json.loads(out)
    except ValueError:
        raise AgentEnvError(f"{what}: the sandbox printed no entry list (is python3 in its image?)") from None


def _entry(sb: Sandbox, d: dict, as_home: bool) -> Entry:
    return Entry(name=d["name"], type=d["type"], is_symlink=d["is_symlink"],
                 path=_shown(sb, d["path"], as_home) or d["path"], size=int(d["size"]), mode=int(d["mode"]),
                 permissions=d["permissions"], owner=d["owner"], group=d["group"], mtime=float(d["mtime"]),
                 symlink_target=_shown(sb, d["symlink_target"], as_home), metadata=dict(d["metadata"]))


def stat(sb: Sandbox, path: str) -> Entry:
    full = sandbox_path(sb, path)
    entries = _describe(sb, full, 0, f"stat {path!r}")
    if not entries:
        raise FileNotFoundInSandbox(f"stat {path!r}: no such file or directory")
    return entries[0]


def list_dir(sb: Sandbox, path: str, depth: int) -> list[Entry]:
    if not 1 <= depth <= _MAX_DEPTH:
        raise InvalidArgument(f"depth must be from 1 to {_MAX_DEPTH}, got {depth}")
    full = sandbox_path(sb, path)
    return sorted(_describe(sb, full, depth, f"list {path!r}"), key=lambda e: e.path)


def write(sb: Sandbox, path: str, data: bytes, metadata: dict[str, str]) -> Entry:
    """Write a file (parents made, an existing one overwritten in place); its metadata becomes
    `metadata` (`user.e2b.*` extended attributes), whatever it had before."""
    full = sandbox_path(sb, path)
    if physical(sb, full) == _ws(sb):
        raise InvalidArgument(f"{path!r} is the work dir, a directory: give a file path")
    what = f"write {path!r}"
    r = _run(sb, _confined(sb) + 'exec python3 -c "$PY" "$p" "$2"', physical(sb, full),
             json.dumps(metadata), what=what, env={"PY": fs_scripts.WRITE}, stdin=data)
    return _entry(sb, _json(r.stdout, what)[0], _under(full, home_dir(sb)))


def make_dir(sb: Sandbox, path: str) -> Entry:
    full = sandbox_path(sb, path)
    _run(sb, _confined(sb) + f'{{ [ -e "$p" ] || [ -L "$p" ]; }} && exit {EXIT_EXISTS}; mkdir -p -- "$p"',
         physical(sb, full), what=f"make dir {path!r}")
    return stat(sb, full)


def move(sb: Sandbox, source: str, destination: str) -> Entry:
    src, dst = sandbox_path(sb, source), sandbox_path(sb, destination)
    _run(sb, _confined(sb) + _exists() + 's=$p; shift; ' + _confined(sb) + 'mv -T -- "$s" "$p"',
         physical(sb, src), physical(sb, dst), what=f"move {source!r} to {destination!r}")
    return stat(sb, dst)


def remove(sb: Sandbox, path: str) -> None:
    """Remove a file or a directory tree; a path with nothing there is fine (envd's remove succeeds)."""
    full = physical(sb, sandbox_path(sb, path))
    if full == _ws(sb):
        raise PathOutsideWorkspace(f"refusing to remove the work dir {path!r} itself")
    _run(sb, _confined(sb) + 'rm -rf -- "$p"', full, what=f"remove {path!r}")
