"""The protocol of the scripts that move files in and out of a sandbox: each is one exec of `sh -c SCRIPT sh
PATH ...` whose prologue (`confine`) resolves the path inside the sandbox, symlinks included, and refuses it
outside the work dir; each outcome the caller must tell apart is an exit code (`EXIT_*`), which
`file_error` turns into the typed error callers see. `Sandbox.read_file`/`write_file` and the server's
filesystem calls (`agentenv.server.fsops`, whose Python programs are `agentenv.server.fs_scripts`) share it.
"""

from __future__ import annotations

import shlex

from agentenv.errors import (
    AgentEnvError,
    FileExistsInSandbox,
    FileNotFoundInSandbox,
    InvalidArgument,
    NotADirectoryInSandbox,
    PathOutsideWorkspace,
)

EXIT_REFUSED = 3   # the path resolves outside the work dir
EXIT_TOO_BIG = 4   # the file is larger than the sandbox's file_limit_bytes
EXIT_MISSING = 5   # no such file or directory
EXIT_EXISTS = 6    # something exists at the path already
EXIT_NOT_DIR = 7   # the path is no directory


def confine(workspace: str, *, workdir_too: bool = False) -> str:
    """Shell prologue: $1 must resolve (symlinks included) to a path below the work dir, which it then
    leaves in $p; with `workdir_too` the work dir itself is allowed too (listing it is the common case)."""
    ws = workspace.rstrip("/")
    below = (f'p=$1; r=$(realpath -m -- "$p") || exit {EXIT_REFUSED}; case "$r" in {shlex.quote(ws)}/*) ;; '
             f'*) echo "$p resolves to $r, outside {workspace}" >&2; exit {EXIT_REFUSED};; esac')
    if workdir_too:
        return f'if [ "$1" = {shlex.quote(ws or "/")} ]; then p=$1; else {below}; fi; '
    return below + "; "


def read_script(workspace: str, limit: int) -> str:
    """`sh -c SCRIPT sh PATH`: the regular file's bytes on stdout, at most `limit` of them."""
    return confine(workspace) + (
        f'[ -e "$p" ] || {{ echo "no such file: $p" >&2; exit {EXIT_MISSING}; }}; '
        '[ -f "$p" ] || { echo "$p is not a regular file" >&2; exit 2; }; '
        f'[ "$(stat -c %s -- "$p")" -le {limit} ] || exit {EXIT_TOO_BIG}; '
        'exec cat -- "$p"')


def write_script(workspace: str) -> str:
    """`sh -c SCRIPT sh PATH MODE`, the bytes on stdin: parents made, the file replaced, its mode set."""
    return confine(workspace) + 'mkdir -p -- "$(dirname -- "$p")" && cat > "$p" && chmod "$2" -- "$p"'


def file_error(exit_code: int, stderr: str, *, what: str, path: str, sandbox_id: str,
               limit: int | None = None, timed_out: bool = False) -> AgentEnvError | None:
    """The error a file script's outcome means, None when it succeeded. `what` names the call ("read
    'a.txt'"), `path` the path it acted on, `limit` the file_limit_bytes a read was held to."""
    if exit_code == 0 and not timed_out:
        return None
    msg = stderr.strip()
    if exit_code == EXIT_REFUSED:
        return PathOutsideWorkspace(f"{what} refused: {msg}")
    if exit_code == EXIT_TOO_BIG:
        return InvalidArgument(f"{what}: {path} is bigger than file_limit_bytes={limit}")
    if exit_code == EXIT_MISSING:
        return FileNotFoundInSandbox(f"{what} in sandbox {sandbox_id}: no such file or directory: {path}")
    if exit_code == EXIT_EXISTS:
        return FileExistsInSandbox(f"{what}: {path} exists already")
    if exit_code == EXIT_NOT_DIR:
        return NotADirectoryInSandbox(f"{what}: {path} is not a directory")
    if timed_out:
        return AgentEnvError(f"could not {what} in sandbox {sandbox_id}: it took longer than the sandbox's "
                             "exec_timeout_s, which bounds file calls too")
    return AgentEnvError(f"could not {what} in sandbox {sandbox_id}: {msg or f'exit {exit_code}'}")
