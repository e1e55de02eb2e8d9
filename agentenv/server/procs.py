"""Long-running processes in a sandbox that survive pause, resume and fork: envd's `process.Process`.

A process started through the API must keep running while its sandbox is checkpointed, so nothing of
it may lead out of the container (CRIU cannot dump a process whose stdio are pipes to the Docker daemon,
see docs/agentenv.md "Limits"). Each process therefore lives entirely inside the sandbox:

* one short `Sandbox.exec` runs a launcher that starts a detached wrapper (`setsid`, stdio on
  /dev/null) and prints the command's PID; the wrapper runs the command in its own process group with
  stdout/stderr redirected to files under `PROC_ROOT` (a tmpfs, dumped with the sandbox), waits for it
  and writes its exit code to a file;
* stdin, when asked for, is a named FIFO whose write end a `sleep infinity` keeper holds open, so the
  command sees EOF only when CloseStdin kills the keeper;
* the host follows output by reading those files through `/proc/<container init>/root` (no exec per
  read), writes stdin into the FIFO the same way, and signals with one `Sandbox.exec` of `kill`.

So a paused sandbox holds no host-side handle of its processes; after a resume (or in a fork) the same
files continue. Needs root on the host, as the checkpoint backends do.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend import docker_client
from agentenv.errors import (
    AgentEnvError,
    InvalidArgument,
    ProcessNotFound,
    SandboxBusy,
    SandboxNotFound,
    SandboxStateError,
)
from agentenv.locks import sandbox_lock
from agentenv.sandbox import Sandbox, runtime
from agentenv.server import fsops
from agentenv.server.pty_bridge import BRIDGE
from agentenv.server.users import SANDBOX_USER

PROC_ROOT = "/tmp/.agentenv-e2b"
CHUNK = 32 * 1024            # bytes per data event
MAX_READ = 1024 * 1024       # bytes read per stream per poll (bounds the server's memory per stream)
LAUNCH_TIMEOUT_S = 30.0
STDIN_WRITE_TIMEOUT_S = 10.0
_EXIT_BAD_CWD = 96

# $1 dir, $2 stdin flag (1/0), $3... argv. Runs as a session leader with stdio on /dev/null.
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
echo "$p" > "$d/pid.tmp" && mv "$d/pid.tmp" "$d/pid"
wait "$p"; c=$?
[ -n "$k" ] && kill "$k" 2>/dev/null
echo "$c" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
"""

# $1 base dir, $2 tag, $3 stdin flag, $4... argv. Prints the command's PID.
_LAUNCHER = r"""
b=$1; t=$2; s=$3; shift 3; d="$b/t.$t"
mkdir -p "$b" && mkdir "$d" || exit 97
find "$b" -mindepth 2 -maxdepth 2 -name exit -mmin +30 2>/dev/null | while read -r f; do
  rm -rf "${f%/exit}"; done
find "$b" -maxdepth 1 -type l ! -exec test -e {} \; -delete 2>/dev/null
[ "$s" = 1 ] && { mkfifo "$d/in" || exit 97; }
w=$W; unset W
setsid sh -c "$w" wrapper "$d" "$s" "$@" < /dev/null > /dev/null 2>&1 &
i=0; while [ ! -f "$d/pid" ]; do i=$((i+1)); [ "$i" -gt 2000 ] && exit 98; sleep 0.005; done
p=$(cat "$d/pid"); ln -sfn "t.$t" "$b/p.$p" && echo "$p"
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
    if sb.status != "running" or not sb.container_id:
        raise SandboxStateError(f"sandbox {sb.id} is {sb.status}; connect to it (resume) first")
    info = docker_client.api().inspect_container(sb.container_id)
    pid = int(info["State"].get("Pid") or 0)
    if not info["State"].get("Running") or pid <= 0:
        raise SandboxStateError(f"sandbox {sb.id}'s container is not running")
    root = Path(f"/proc/{pid}/root")
    try:
        os.stat(root / PROC_ROOT.lstrip("/"))
    except FileNotFoundError:
        pass
    except PermissionError:
        raise AgentEnvError("the server cannot read sandbox files through /proc/<pid>/root: run "
                            "`agentenv serve` as root (as the checkpoint backends need)") from None
    return root


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


def _proc_dir(root: Path, pid: int) -> Path:
    return root / PROC_ROOT.lstrip("/") / f"p.{pid}"


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
        env = {"HOME": fsops.home_dir(sb), "USER": SANDBOX_USER, **envs, "PWD": workdir, "W": _WRAPPER}
        r = sb.exec(argv, timeout=LAUNCH_TIMEOUT_S, env=env, workdir=workdir)
        if r.exit_code != 0 or not r.stdout.strip().isdigit():
            detail = (r.stderr or r.stdout).strip()[:300] or f"exit {r.exit_code}"
            if "workdir" in detail or "chdir" in detail or "no such file" in detail.lower():
                raise AgentEnvError(f"cannot start {cmd!r} in {workdir!r}: {detail}")
            raise AgentEnvError(f"could not start {cmd!r} in sandbox {sb.id}: {detail}")
        pid = int(r.stdout.strip())
        shown = (args[5], args[6:]) if pty is not None else (cmd, list(args))  # the command, not the bridge
        meta = {"pid": pid, "tag": tag, "cmd": shown[0], "args": list(shown[1]), "envs": dict(envs),
                "cwd": cwd, "pty": pty is not None}
        root = _container_root(sb)
        (_proc_dir(root, pid) / "meta.json").write_text(json.dumps(meta))
        return pid

    def list(self, sb: Sandbox) -> list[ProcInfo]:
        """Processes started through the API that have not exited yet."""
        base = _container_root(sb) / PROC_ROOT.lstrip("/")
        out = []
        with contextlib.suppress(FileNotFoundError):
            for link in sorted(base.glob("p.*")):
                if (link / "exit").exists():
                    continue
                meta = _read_meta(link)
                if meta is not None:
                    out.append(meta)
        return out

    def resolve(self, sb: Sandbox, pid: int | None = None, tag: str | None = None) -> int:
        """The PID of a live or finished API process chosen by PID or by tag."""
        if pid is not None:
            if not (_proc_dir(_container_root(sb), pid) / "pid").exists():
                raise ProcessNotFound(f"process with pid {pid} not found in sandbox {sb.id}")
            return pid
        for info in self.list(sb):
            if tag is not None and info.tag == tag:
                return info.pid
        raise ProcessNotFound(f"process with tag {tag!r} not found in sandbox {sb.id}")

    # ---- input and signals --------------------------------------------------------------------
    def send_input(self, sb: Sandbox, pid: int, data: bytes) -> None:
        """Write `data` to the process's stdin FIFO (it must have been started with stdin)."""
        d = _proc_dir(_container_root(sb), pid)
        fifo = d / "in"
        if not fifo.exists() or (d / "exit").exists():
            raise ProcessNotFound(f"process {pid} has no open stdin (started without stdin, closed, or "
                                  "exited)")
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise ProcessNotFound(f"process {pid} has no reader on its stdin any more") from None
            raise
        deadline = time.monotonic() + STDIN_WRITE_TIMEOUT_S
        view = memoryview(data)
        try:
            while view:
                try:
                    n = os.write(fd, view)
                    view = view[n:]
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise AgentEnvError(f"process {pid} did not read its stdin for "
                                            f"{STDIN_WRITE_TIMEOUT_S:g} s") from None
                    time.sleep(0.01)
                except BrokenPipeError:
                    raise ProcessNotFound(f"process {pid} closed its stdin") from None
        finally:
            os.close(fd)

    def resize(self, sb: Sandbox, pid: int, rows: int, cols: int) -> None:
        """A PTY process's new terminal size (its bridge applies it; the program gets SIGWINCH)."""
        if not (0 < rows < 65536 and 0 < cols < 65536):
            raise InvalidArgument(f"a PTY's size must be 1..65535 rows and columns, got {rows}x{cols}")
        d = _proc_dir(_container_root(sb), pid)
        if not (d / "pid").exists():
            raise ProcessNotFound(f"process with pid {pid} not found in sandbox {sb.id}")
        if not _is_pty(d):
            raise InvalidArgument(f"process {pid} has no PTY to resize (it was started without one)")
        if (d / "exit").exists():
            raise ProcessNotFound(f"process {pid} has exited")
        ctl = d / "ctl"
        deadline = time.monotonic() + 2.0
        while not ctl.exists():  # the bridge makes it as it starts
            if time.monotonic() > deadline:
                raise AgentEnvError(f"process {pid}'s terminal did not start")
            time.sleep(0.01)
        fd = os.open(ctl, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, f"{rows} {cols}\n".encode())
        finally:
            os.close(fd)

    def close_stdin(self, sb: Sandbox, pid: int) -> None:
        """EOF on the process's stdin: stop the keeper that holds the FIFO's write end open."""
        d = _proc_dir(_container_root(sb), pid)
        try:
            keeper = int((d / "keeper").read_text())
        except (FileNotFoundError, ValueError):
            raise ProcessNotFound(f"process {pid} was not started with stdin") from None
        self._kill(sb, "TERM", str(keeper))

    def signal(self, sb: Sandbox, pid: int, signame: str) -> None:
        """SIGTERM/SIGKILL to the process's whole group (it leads one: the wrapper ran it under setsid)."""
        d = _proc_dir(_container_root(sb), pid)
        if not (d / "pid").exists():
            raise ProcessNotFound(f"process with pid {pid} not found in sandbox {sb.id}")
        if (d / "exit").exists():
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
            root = await asyncio.to_thread(_container_root, sb)
        except SandboxStateError as e:  # not running: killed meanwhile is told apart, the rest as it was
            stopped = await asyncio.to_thread(_stopped, sb, pid)
            raise (stopped if isinstance(stopped, SandboxKilled) else e) from None
        d = _proc_dir(root, pid)
        offsets = {"stdout": 0, "stderr": 0, "pty": 0}
        is_pty = await asyncio.to_thread(_is_pty, d)
        files = {"pty" if is_pty else "stdout": d / "out", "stderr": d / "err"}
        if not from_start:
            for k, f in files.items():
                with contextlib.suppress(FileNotFoundError):
                    offsets[k] = f.stat().st_size
        while True:
            try:
                exited = (d / "exit").exists()
                while True:  # once exited, drain everything; before, one MAX_READ per stream per poll
                    chunks = [(kind, c) for kind, path in files.items()
                              for c in _read_from(path, offsets, kind)]
                    for kind, chunk in chunks:
                        yield OutputEvent(kind, chunk)
                    if not (exited and chunks):
                        break
                if exited:
                    code = int((d / "exit").read_text().strip() or -1)
                    yield OutputEvent("end", exit_code=code)
                    return
                if not (d / "pid").exists():
                    raise FileNotFoundError(d)
            except (FileNotFoundError, ProcessLookupError, NotADirectoryError, ValueError):
                if not root.exists() or not os.path.exists(root / "proc"):
                    raise await asyncio.to_thread(_stopped, sb, pid) from None
                raise ProcessNotFound(f"process {pid}'s files vanished from sandbox {sb.id}") from None
            await asyncio.sleep(self.poll_s)


def _read_from(path: Path, offsets: dict[str, int], kind: str) -> list[bytes]:
    """New bytes of `path` past offsets[kind], in chunks of at most CHUNK (advances the offset)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return []
    if size <= offsets[kind]:
        return []
    with open(path, "rb") as f:
        f.seek(offsets[kind])
        data = f.read(min(size - offsets[kind], MAX_READ))  # the rest on the next poll
    offsets[kind] += len(data)
    return [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]


def _is_pty(d: Path) -> bool:
    try:
        return bool(json.loads((d / "meta.json").read_text()).get("pty"))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False


def _read_meta(d: Path) -> ProcInfo | None:
    try:
        m = json.loads((d / "meta.json").read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return ProcInfo(int(m["pid"]), m.get("tag"), m["cmd"], list(m["args"]), dict(m["envs"]), m.get("cwd"))
