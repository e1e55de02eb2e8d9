"""Run host programs inside a running container's namespaces: CRIU, so that a dump sees the sandbox's
processes as its own and a restore puts a process tree back into a container that already runs (its
namespaces, cgroup and mounts stay; CRIU rebuilds none of them), and tar, for the contents of its tmpfs
mounts.

Design: docs/design/sandboxes.md#agentenv-backend-nsexec.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from agentenv.backend.cgroups import cgroup_dirs
from agentenv.errors import BackendUnavailable

PR_SET_MEMORY_MERGE = 67  # prctl option (Linux >= 6.4): every anonymous page of the process is KSM-able
WRAPPER_RE = re.compile(r"exec\s+(\S+)\s+--library-path\s+(\S+)\s+(\S+)\s+\"\$@\"")


@dataclass(frozen=True)
class Program:
    """A host binary runnable from inside another mount namespace: its ELF loader, the directories of
    its libraries and the binary itself, all opened on the host before the namespaces change."""

    loader: str
    library_path: tuple[str, ...]
    binary: str

    def open(self) -> list[int]:
        """Descriptors of loader, library dirs and binary, in that order (the caller closes them)."""
        paths = (self.loader, *self.library_path, self.binary)
        return [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]

    @staticmethod
    def argv(fds: Sequence[int]) -> list[str]:
        """The command line that runs the program from descriptors `fds` (as returned by `open`)."""
        paths = [f"/proc/self/fd/{fd}" for fd in fds]
        return [paths[0], "--library-path", ":".join(paths[1:-1]), paths[-1]]


def _elf_loader(binary: str) -> str:
    """The ELF interpreter (PT_INTERP) of a dynamically linked binary."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        part = line.strip().split()[0] if line.strip() else ""
        if part.startswith("/") and "ld-linux" in part:
            return part
    raise BackendUnavailable(f"cannot find the ELF loader of {binary} (ldd printed {out[:200]!r})")


def _library_dirs(binary: str) -> tuple[str, ...]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    dirs: list[str] = []
    for line in out.splitlines():
        m = re.search(r"=>\s+(/\S+)", line)
        if m and (d := os.path.dirname(m.group(1))) not in dirs:
            dirs.append(d)
    return tuple(dirs)


@lru_cache(maxsize=8)
def host_program(name: str) -> Program:
    """A dynamically linked host program (`tar`), with the host's loader and libraries."""
    path = shutil.which(name)
    if path is None:
        raise BackendUnavailable(f"{name} is not on PATH")
    real = os.path.realpath(path)
    return Program(_elf_loader(real), _library_dirs(real), real)


@lru_cache(maxsize=1)
def criu_program() -> Program:
    """CRIU as this host runs it: the private prefix behind the bootstrap's wrapper script (its own loader
    and libraries), or a system CRIU with the host's loader and libraries."""
    path = shutil.which("criu")
    if path is None:
        raise BackendUnavailable("criu is not on PATH (run make bootstrap)")
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"#!"):
        m = WRAPPER_RE.search(head.decode(errors="replace"))
        if m is None:
            raise BackendUnavailable(f"{path} is a script that does not exec CRIU through a loader; "
                                     "point PATH at the criu binary")
        loader, libs, binary = m.groups()
        return Program(loader, tuple(d for d in libs.split(":") if os.path.isdir(d)), binary)
    return host_program("criu")


def cgroup_procs_files(init_pid: int) -> list[str]:
    """The `cgroup.procs` file of every cgroup hierarchy the container's init belongs to."""
    files = []
    for directory in {str(d) for d in cgroup_dirs(init_pid).values()}:
        procs = Path(directory) / "cgroup.procs"
        if procs.exists():
            files.append(str(procs))
    return sorted(files)


def _merge_pages() -> None:
    """`preexec_fn`: make every process this one execs or forks KSM-mergeable (PR_SET_MEMORY_MERGE)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        os.write(2, b"prctl(PR_SET_MEMORY_MERGE) failed\n")


def bump_last_pid(init_pid: int, last_pid: int, timeout_s: float) -> None:
    """Set the container's `ns_last_pid`, so that the next processes started in it (CRIU's own) get PIDs
    above `last_pid` and leave every PID of the tree to restore free."""
    subprocess.run(["nsenter", "-t", str(init_pid), "-p", "--", "sh", "-c",
                    'echo "$1" > /proc/sys/kernel/ns_last_pid', "sh", str(int(last_pid))],
                   check=True, timeout=timeout_s, capture_output=True)


def _in_cgroups(init_pid: int, chain: list[str]) -> tuple[list[str], dict[str, str]]:
    """`chain` behind a shell that first moves itself into every cgroup of the container (so that what
    the chain runs is charged to, and limited by, the container), with the environment it needs."""
    procs = cgroup_procs_files(init_pid)
    if not procs:
        if not Path(f"/proc/{init_pid}").exists():
            raise ProcessLookupError(f"process {init_pid} has no cgroup: its container stopped")
        raise BackendUnavailable(f"the cgroups of process {init_pid} are not mounted under /sys/fs/cgroup in "
                                 "this process's mount namespace: run AgentENV where the host's cgroups are")
    script = 'for f in $CG; do echo $$ > "$f" || exit 97; done; exec "$@"'
    env = {"CG": " ".join(procs), "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    return ["sh", "-c", script, "sh", *chain], env


def start_criu(init_pid: int, args: Sequence[str], dirs: Sequence[Path], *, join_cgroups: bool,
               merge_pages: bool = False) -> subprocess.Popen:
    """Start `criu ARGS` inside the namespaces of the container whose init is host pid `init_pid`, and
    with `join_cgroups` inside its cgroups (a restore: the tree it makes belongs there; a dump stays in
    the caller's, so that CRIU's buffers never count against the sandbox's memory limit).

    `{0}`, `{1}`, ... in `args` become descriptor paths of `dirs` (images, work dir). The chain runs in a
    session of its own on the host (a Ctrl-C of the caller does not interrupt a dump halfway); with
    `merge_pages` every process CRIU restores is KSM-mergeable."""
    program = criu_program()
    fds: list[int] = []
    try:
        fds = program.open() + [os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for d in dirs]
        n_prog = len(fds) - len(dirs)
        dir_paths = [f"/proc/self/fd/{fd}" for fd in fds[n_prog:]]
        criu_argv = [*Program.argv(fds[:n_prog]), *[a.format(*dir_paths) for a in args]]
        pid = str(init_pid)
        chain: list[str] = ["nsenter", "-t", pid, "-p", "--", "setsid", "-f", "-w",
                            "nsenter", "-t", pid, "-m", "-n", "-i", "-u", "-C", "--", *criu_argv]
        env = None
        if join_cgroups:
            chain, env = _in_cgroups(init_pid, chain)
        return subprocess.Popen(chain, pass_fds=fds, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=_merge_pages if merge_pages else None)
    finally:
        for fd in fds:
            os.close(fd)


def run_in_mounts(init_pid: int, program: Program, args: Sequence[str], *, timeout_s: float,
                  join_cgroups: bool, stdin: int | None = None,
                  stdout: int | None = None) -> subprocess.CompletedProcess:
    """Run a host `program` with `args` in the container's pid and mount namespaces (its root is `/`), as
    root on the host: paths it opens resolve inside the container, never on the host; with `join_cgroups`
    what it writes to a tmpfs is charged to the container. `stdin`/`stdout`: open descriptors of host
    files (e.g. a tar archive). Raises CalledProcessError with its stderr."""
    fds = program.open()
    try:
        chain: list[str] = ["nsenter", "-t", str(init_pid), "-p", "-m", "--", *Program.argv(fds), *args]
        env = None
        if join_cgroups:
            chain, env = _in_cgroups(init_pid, chain)
        return subprocess.run(chain, pass_fds=fds, env=env,
                              stdin=stdin if stdin is not None else subprocess.DEVNULL,
                              stdout=stdout if stdout is not None else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=timeout_s, check=True)
    finally:
        for fd in fds:
            os.close(fd)
