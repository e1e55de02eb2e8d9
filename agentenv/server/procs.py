"""Long-running processes in a sandbox that survive pause, resume and fork: envd's `process.Process`.

CRIU cannot dump a process whose stdio lead out of the container, so each process lives entirely inside
the sandbox (a detached wrapper, output in files on a dumped tmpfs, stdin a FIFO); the host reads and
writes those files, and a paused sandbox holds no host-side handle of its processes.

Design: docs/design/sandboxes.md#agentenv-server-procs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.base import ContainerNotRunning, ContainerRef, LiveFiles
from agentenv.errors import (
    AgentEnvError,
    InvalidArgument,
    ProcessNotFound,
    SandboxBusy,
    SandboxNotFound,
    SandboxStateError,
)
from agentenv.locks import sandbox_lock
from agentenv.runtime import runtime
from agentenv.sandbox import Sandbox
from agentenv.server import fsops
from agentenv.server.pty_bridge import BRIDGE
from agentenv.server.users import SANDBOX_USER

PROC_ROOT = "/tmp/.agentenv-e2b"
CHUNK = 32 * 1024            # bytes per data event
MAX_READ = 1024 * 1024       # bytes read per stream per poll (bounds the server's memory per stream)
LAUNCH_TIMEOUT_S = 30.0
STDIN_WRITE_TIMEOUT_S = 10.0
_EXIT_BAD_CWD = 96

# $1 dir, $2 stdin flag (1/0), $3... argv. Runs as a session leader with stdin and stderr on /dev/null; prints
# the command's PID on stdout (the launcher's pipe), then lets go of it.
_WRAPPER = r"""
d=$1; s=$2; shift 2; k=
if [ "$s" = 1 ]; then
  sleep infinity > "$d/in" & k=$!
  echo "$k" > "$d/keeper"
  setsid "$@" < "$d/in" > "$d/out" 2> "$d/err" &
else
  setsid "$@" < /dev/null > "$d/out" 2> "$d/err" &
fi
p=$!
echo "$p" > "$d/pid"
echo "$p"; exec > /dev/null
wait "$p"; c=$?
[ -n "$k" ] && kill "$k" 2>/dev/null
echo "$c" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
"""

# $1 base dir, $2 tag, $3 stdin flag, $4... argv. Prints the command's PID. Few processes of its own (each
# costs a fork and an exec, which is dear in an emulated guest): the wrapper hands the PID back through
# the command substitution's pipe, and the clean-up of old folders runs on in the background.
_LAUNCHER = r"""
b=$1; t=$2; s=$3; shift 3; d="$b/t.$t"
mkdir -p "$b" && mkdir "$d" || exit 97
( find "$b" -mindepth 2 -maxdepth 2 -name exit -mmin +30 2>/dev/null | while read -r f; do
    rm -rf "${f%/exit}"; done
  for l in "$b"/p.*; do [ -e "$l" ] || [ ! -L "$l" ] || rm -f "$l"; done ) </dev/null >/dev/null 2>&1 &
[ "$s" = 1 ] && { mkfifo "$d/in" || exit 97; }
w=$W; unset W
p=$(setsid sh -c "$w" wrapper "$d" "$s" "$@" < /dev/null 2> /dev/null &)
[ -n "$p" ] || exit 98
ln -sfn "t.$t" "$b/p.$p" && echo "$p"
"""


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None


@dataclass(frozen=True)
class OutputEvent:
    """One step of a followed process: `kind` is 'stdout' or 'stderr' (with `data`) or 'end' (`exit_code`)."""

    kind: str
    data: bytes = b""
    exit_code: int = 0


def _container_root(sb: Sandbox) -> Path:
    """`/proc/<init>/root` of the sandbox's running container: its filesystem as the host sees it."""
    try:
        root = runtime().backend.container_root(ContainerRef(sb.container_id or "", ""))
    except ContainerNotRunning as e:  # it died behind our back: marked broken, as a failed exec does
        raise sb._container_lost(str(e)) from None
    try:
        os.stat(root / PROC_ROOT.lstrip("/"))
    except FileNotFoundError:
        pass
    except PermissionError:
        raise AgentEnvError("the server cannot read sandbox files through /proc/<pid>/root: run "
                            "`agentenv serve` as root (as the checkpoint backends need)") from None
    return root


class RootFiles(LiveFiles):
    """A container's files through `/proc/<its init>/root` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _p(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def read_many(self, offsets: Mapping[str, int], limit: int) -> dict[str, tuple[int, bytes] | None]:
        out: dict[str, tuple[int, bytes] | None] = {}
        for path, offset in offsets.items():
            try:
                st = os.stat(self._p(path))
                if not stat.S_ISREG(st.st_mode):  # a FIFO (a process's stdin): it exists, nothing to read
                    out[path] = (st.st_size, b"")
                    continue
                with open(self._p(path), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(offset)
                    out[path] = (size, f.read(max(0, min(limit, size - offset))))
            except (FileNotFoundError, NotADirectoryError):
                out[path] = None
        return out

    def write(self, path: str, data: bytes) -> None:
        self._p(path).write_bytes(data)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(self._p(path)))

    def write_fifo(self, path: str, data: bytes, timeout_s: float) -> None:
        try:
            fd = os.open(self._p(path), os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise ConnectionRefusedError(str(e)) from None
            raise
        deadline = time.monotonic() + timeout_s
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{path} was not read for {timeout_s:g} s") from None
                    time.sleep(0.01)
        finally:
            os.close(fd)

    def tree_usage(self, path: str) -> tuple[int, int]:
        total = 0
        for dirpath, _dirs, names in os.walk(self._p(path)):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total, shutil.disk_usage(self._p(path)).total


def _files(sb: Sandbox) -> LiveFiles:
    """The running sandbox's files as the server reaches them (see the module docstring)."""
    if sb.status != "running" or not sb.container_id:
        raise SandboxStateError(f"sandbox {sb.id} is {sb.status}; connect to it (resume) first")
    rt = runtime()
    try:
        files = rt.backend.live_files(ContainerRef(sb.container_id, ""))
    except ContainerNotRunning as e:  # it died behind our back: marked broken, as a failed exec does
        raise sb._container_lost(str(e)) from None
    return files if files is not None else RootFiles(_container_root(sb))


class SandboxKilled(SandboxStateError):
    """The sandbox was killed (or its time to live ran out) while one of its processes was followed: the
    process is gone with it, so the stream ends as E2B's does then (Connect `unavailable`)."""


def _stopped(sb: Sandbox, pid: int) -> SandboxStateError:
    """The error for a follower whose sandbox stopped under it: `SandboxKilled` when it was killed, a plain
    `SandboxStateError` when it was paused (the process lives on in the checkpoint). The pause or kill
    that stopped the container holds the sandbox's lock until the registry says which it was, so this
    waits for that lock (at most the sandbox's `lock_timeout_s`) before reading the state."""
    with contextlib.suppress(SandboxBusy):
        with sandbox_lock(runtime().registry.lock_dir, sb.id, sb.config.lock_timeout_s, "follow a process"):
            pass
    try:
        status = sb.status
    except SandboxNotFound:
        status = "closed"
    if status == "closed":
        return SandboxKilled(f"sandbox {sb.id} was killed while process {pid} was followed; the stream "
                             "ended before the process did")
    if status == "paused":
        return SandboxStateError(f"sandbox {sb.id} was paused while process {pid} was followed; the process "
                                 "continues after a resume (connect)")
    return SandboxStateError(f"sandbox {sb.id} was stopped while process {pid} was followed (it is {status} "
                             "now, e.g. after the pause of a fork or snapshot); follow the process again")


def _proc_dir(pid: int) -> str:
    return f"{PROC_ROOT}/p.{pid}"


def _exists(files: LiveFiles, *paths: str) -> list[bool]:
    found = files.read_many(dict.fromkeys(paths, 0), 0)
    return [found[p] is not None for p in paths]


def _text(files: LiveFiles, path: str) -> str | None:
    got = files.read_many({path: 0}, MAX_READ)[path]
    return None if got is None else got[1].decode(errors="replace")


class ProcessManager:
    """Start, list, follow, feed and signal API-started processes of sandboxes (stateless on the host:
    everything it needs is in the sandbox, so it survives server restarts, pauses and forks)."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s

    # ---- start / list -------------------------------------------------------------------------
    def start(self, sb: Sandbox, cmd: str, args: Sequence[str], envs: Mapping[str, str], cwd: str | None,
              stdin: bool, tag: str | None, pty: tuple[int, int] | None = None) -> int:
        """Start `cmd args...` detached in the sandbox; returns its PID (inside the sandbox). It starts in
        `cwd`, a relative one taken from the sandbox's home (`fsops.home_dir`, as envd resolves it against
        the user's home), or in the home itself when `cwd` is empty. With `pty` (rows, cols) it runs on a
        terminal of that size (`pty_bridge`): its input is the stdin FIFO, its output one stream."""
        if pty is not None:
            rows, cols = pty
            if not (0 < rows < 65536 and 0 < cols < 65536):
                raise InvalidArgument(f"a PTY's size must be 1..65535 rows and columns, got {rows}x{cols}")
        if not cmd:
            raise AgentEnvError("process.cmd is empty: give the program to run")
        if cwd is not None and "\0" in cwd:
            raise InvalidArgument(f"process.cwd must not contain NUL bytes, got {cwd!r}")
        tag_dir = secrets.token_hex(8)
        if pty is not None:
            stdin = True
            ctl = f"{PROC_ROOT}/t.{tag_dir}/ctl"
            args, cmd = [BRIDGE, str(pty[0]), str(pty[1]), ctl, cmd, *args], "python3"
            args.insert(0, "-c")
        argv = ["sh", "-c", _LAUNCHER, "launcher", PROC_ROOT, tag_dir, "1" if stdin else "0", cmd, *args]
        workdir = fsops.resolve(sb, cwd) if cwd else fsops.home_dir(sb)
        # HOME and USER as in E2B's sandboxes; PWD keeps the directory's name as given (the home is a
        # symlink to the work dir), so `pwd` prints /home/user, not /workspace
        env = {"HOME": fsops.home_dir(sb), "USER": SANDBOX_USER, **envs, "PWD": workdir}
        files = _files(sb)
        try:
            started = files.start_detached(PROC_ROOT, tag_dir, [cmd, *args], env, workdir, stdin)
        except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
            raise AgentEnvError(f"cannot start {cmd!r} in {workdir!r}: {e}") from None
        except ContainerNotRunning as e:  # it died behind our back (a killed VM): gone, as a failed exec
            raise sb._container_lost(str(e)) from None
        if started is not None:
            pid = started
        else:
            r = sb.exec(argv, timeout=LAUNCH_TIMEOUT_S, env={**env, "W": _WRAPPER}, workdir=workdir)
            if r.exit_code != 0 or not r.stdout.strip().isdigit():
                detail = (r.stderr or r.stdout).strip()[:300] or f"exit {r.exit_code}"
                if "workdir" in detail or "chdir" in detail or "no such file" in detail.lower():
                    raise AgentEnvError(f"cannot start {cmd!r} in {workdir!r}: {detail}")
                raise AgentEnvError(f"could not start {cmd!r} in sandbox {sb.id}: {detail}")
            pid = int(r.stdout.strip())
        shown = (args[5], args[6:]) if pty is not None else (cmd, list(args))  # the command, not the bridge
        meta = {"pid": pid, "tag": tag, "cmd": shown[0], "args": list(shown[1]), "envs": dict(envs),
                "cwd": cwd, "pty": pty is not None}
        files.write(f"{_proc_dir(pid)}/meta.json", json.dumps(meta).encode())
        return pid

    def list(self, sb: Sandbox) -> list[ProcInfo]:
        """Processes started through the API that have not exited yet."""
        files = _files(sb)
        try:
            links = [n for n in files.listdir(PROC_ROOT) if n.startswith("p.")]
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = files.read_many({f"{PROC_ROOT}/{n}/{f}": 0 for n in links for f in ("exit", "meta.json")},
                                MAX_READ)
        out = []
        for n in links:
            meta = found[f"{PROC_ROOT}/{n}/meta.json"]
            if found[f"{PROC_ROOT}/{n}/exit"] is None and meta is not None:
                info = _parse_meta(meta[1])
                if info is not None:
                    out.append(info)
        return out

    def resolve(self, sb: Sandbox, pid: int | None = None, tag: str | None = None) -> int:
        """The PID of a live or finished API process chosen by PID or by tag."""
        if pid is not None:
            if not _exists(_files(sb), f"{_proc_dir(pid)}/pid")[0]:
                raise ProcessNotFound(f"process with pid {pid} not found in sandbox {sb.id}")
            return pid
        for info in self.list(sb):
            if tag is not None and info.tag == tag:
                return info.pid
        raise ProcessNotFound(f"process with tag {tag!r} not found in sandbox {sb.id}")

    # ---- input and signals --------------------------------------------------------------------
    def send_input(self, sb: Sandbox, pid: int, data: bytes) -> None:
        """Write `data` to the process's stdin FIFO (it must have been started with stdin)."""
        files, d = _files(sb), _proc_dir(pid)
        fifo, exited = _exists(files, f"{d}/in", f"{d}/exit")
        if not fifo or exited:
            raise ProcessNotFound(f"process {pid} has no open stdin (started without stdin, closed, or "
                                  "exited)")
        try:
            files.write_fifo(f"{d}/in", data, STDIN_WRITE_TIMEOUT_S)
        except ConnectionRefusedError:
            raise ProcessNotFound(f"process {pid} has no reader on its stdin any more") from None
        except BrokenPipeError:
            raise ProcessNotFound(f"process {pid} closed its stdin") from None
        except TimeoutError:
            raise AgentEnvError(f"process {pid} did not read its stdin for "
                                f"{STDIN_WRITE_TIMEOUT_S:g} s") from None

    def resize(self, sb: Sandbox, pid: int, rows: int, cols: int) -> None:
        """A PTY process's new terminal size (its bridge applies it; the program gets SIGWINCH)."""
        if not (0 < rows < 65536 and 0 < cols < 65536):
            raise InvalidArgument(f"a PTY's size must be 1..65535 rows and columns, got {rows}x{cols}")
        files, d = _files(sb), _proc_dir(pid)
        found = files.read_many({f"{d}/pid": 0, f"{d}/meta.json": 0, f"{d}/exit": 0}, MAX_READ)
        if found[f"{d}/pid"] is None:
            raise ProcessNotFound(f"process with pid {pid} not found in sandbox {sb.id}")
        meta = found[f"{d}/meta.json"]
        if meta is None or not _is_pty(meta[1]):
            raise InvalidArgument(f"process {pid} has no PTY to resize (it was started without one)")
        if found[f"{d}/exit"] is not None:
            raise ProcessNotFound(f"process {pid} has exited")
        deadline = time.monotonic() + 2.0
        while True:  # the bridge makes its control FIFO as it starts
            try:
                files.write_fifo(f"{d}/ctl", f"{rows} {cols}\n".encode(), 2.0)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise AgentEnvError(f"process {pid}'s terminal did not start") from None
                time.sleep(0.01)

    def close_stdin(self, sb: Sandbox, pid: int) -> None:
        """EOF on the process's stdin: stop the keeper that holds the FIFO's write end open."""
        keeper = _text(_files(sb), f"{_proc_dir(pid)}/keeper")
        if keeper is None or not keeper.strip().isdigit():
            raise ProcessNotFound(f"process {pid} was not started with stdin")
        self._kill(sb, "TERM", keeper.strip())

    def signal(self, sb: Sandbox, pid: int, signame: str) -> None:
        """SIGTERM/SIGKILL to the process's whole group (it leads one: the wrapper ran it under setsid)."""
        started, exited = _exists(_files(sb), f"{_proc_dir(pid)}/pid", f"{_proc_dir(pid)}/exit")
        if not started:
            raise ProcessNotFound(f"process with pid {pid} not found in sandbox {sb.id}")
        if exited:
            return
        self._kill(sb, signame, f"-{pid}")

    def _kill(self, sb: Sandbox, signame: str, target: str) -> None:
        """bash's kill (dash's cannot signal a process group); a target that already exited is fine."""
        r = sb.exec(["bash", "-c", 'kill -s "$1" -- "$2" 2>&1', "kill", signame, target],
                    timeout=LAUNCH_TIMEOUT_S)
        if r.exit_code != 0 and "No such process" not in r.stdout:
            raise AgentEnvError(f"kill -s {signame} {target} failed in sandbox {sb.id}: {r.stdout.strip()}")

    # ---- output -------------------------------------------------------------------------------
    async def follow(self, sb: Sandbox, pid: int, from_start: bool) -> AsyncIterator[OutputEvent]:
        """Output of the process as it is written, then its exit code. `from_start=False` skips what
        was written before the call (envd's Connect). Raises SandboxStateError when the sandbox is paused
        while following (the process itself lives on in the checkpoint), SandboxKilled when it is killed."""
        try:
            files = await asyncio.to_thread(_files, sb)
        except SandboxStateError as e:  # not running: killed meanwhile is told apart, the rest as it was
            stopped = await asyncio.to_thread(_stopped, sb, pid)
            raise (stopped if isinstance(stopped, SandboxKilled) else e) from None
        d = _proc_dir(pid)
        meta = await asyncio.to_thread(_text, files, f"{d}/meta.json")
        is_pty = meta is not None and _is_pty(meta.encode())
        streams = {"pty" if is_pty else "stdout": f"{d}/out", "stderr": f"{d}/err"}
        offsets = dict.fromkeys(streams, 0)
        if not from_start:
            sizes = await asyncio.to_thread(files.read_many, dict.fromkeys(streams.values(), 0), 0)
            offsets = {k: (sizes[p] or (0, b""))[0] for k, p in streams.items()}
        while True:
            try:
                exited = None
                while True:  # once exited, drain everything; before, one MAX_READ per stream per poll
                    # the exit file first: output read after it is found is all there is (read in this order)
                    ask = {f"{d}/exit": 0, f"{d}/pid": 0, **{p: offsets[k] for k, p in streams.items()}}
                    found = await asyncio.to_thread(files.read_many, ask, MAX_READ)
                    if found[f"{d}/pid"] is None:
                        raise FileNotFoundError(d)
                    exit_file = found[f"{d}/exit"]
                    exited = exited or exit_file
                    chunks = []
                    for kind, path in streams.items():
                        got = found[path]
                        if got is not None and got[1]:
                            offsets[kind] += len(got[1])
                            chunks += [(kind, got[1][i:i + CHUNK]) for i in range(0, len(got[1]), CHUNK)]
                    for kind, chunk in chunks:
                        yield OutputEvent(kind, chunk)
                    if not (exit_file is not None and chunks):
                        break
                if exited is not None:
                    code = int(exited[1].decode().strip() or -1)
                    yield OutputEvent("end", exit_code=code)
                    return
            except (FileNotFoundError, ProcessLookupError, NotADirectoryError, ValueError, AgentEnvError,
                    ContainerNotRunning):
                if await asyncio.to_thread(_gone, sb, files):
                    raise await asyncio.to_thread(_stopped, sb, pid) from None
                raise ProcessNotFound(f"process {pid}'s files vanished from sandbox {sb.id}") from None
            await asyncio.sleep(self.poll_s)


def _gone(sb: Sandbox, files: LiveFiles) -> bool:
    """Is the sandbox whose files these are no longer running (paused, killed, stopped)?"""
    if isinstance(files, RootFiles):
        return not files.root.exists() or not os.path.exists(files.root / "proc")
    try:
        ref = ContainerRef(sb.container_id or "", "")
        return sb.status != "running" or runtime().backend.live_files(ref) is None
    except (ContainerNotRunning, SandboxNotFound):
        return True


def _is_pty(meta: bytes) -> bool:
    try:
        return bool(json.loads(meta).get("pty"))
    except ValueError:
        return False


def _parse_meta(meta: bytes) -> ProcInfo | None:
    try:
        m = json.loads(meta)
    except ValueError:
        return None
    return ProcInfo(int(m["pid"]), m.get("tag"), m["cmd"], list(m["args"]), dict(m["envs"]), m.get("cwd"))
