"""The backend seam: everything that touches containers and CRIU goes through `SandboxBackend`.

`agentenv.sandbox.Sandbox` owns states, locks and the registry; a backend owns containers. The one
implementation is `agentenv.backend.runtime.CriuRuntime` (Docker containers, CRIU images in one
checkpoint store); the `fastpath` and `docker-criu` backends differ only in how the dump is made.
Callers outside `agentenv.backend` reach a sandbox's container only through this class (the server's
process files, watchers and metrics included: `container_root`, `workdir_on_host`, `sample`, `find`).
"""

from __future__ import annotations

import abc
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import SandboxConfig
from agentenv.results import ExecResult

# In-container directory (a root-owned tmpfs that every sandbox gets) where the backend keeps
# its restore marker and the sandbox's identity: `sandbox-id` and `seed`, rewritten after every
# create/resume/fork so that forked programs can reseed their PRNGs (forks share all memory).
RUNTIME_DIR = "/run/agentenv"

UIDS = {"agent": "1000:1000", "root": "0:0"}
# Every container and volume carries the registry it belongs to, so `gc` of one $AGENTENV_HOME never
# touches another's (tests use private homes on the same daemon).
LABEL_HOME = "org.k3rl.agentenv.home"
LABEL_SANDBOX = "org.k3rl.agentenv.sandbox"
# The argv of a session's shell (`SandboxBackend.open_shell`); `end_shells` recognises them by it.
SHELL_ARGV = ("sh", "-s", "--", "agentenv-session")


@dataclass(frozen=True)
class RawExec:
    """An exec's outcome with undecoded outputs (file transfer needs the bytes)."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool
    truncated: bool

    def decoded(self, oom_killed: bool = False) -> ExecResult:
        return ExecResult(self.exit_code, self.stdout.decode("utf-8", "replace"),
                          self.stderr.decode("utf-8", "replace"), self.duration_s, self.timed_out,
                          self.truncated, oom_killed)


class ShellStream(abc.ABC):
    """A shell (`SHELL_ARGV`) running in a container, started by `SandboxBackend.open_shell`: its stdin,
    and its stdout/stderr as frames. Reads and writes raise OSError once the shell's connection is gone."""

    @abc.abstractmethod
    def send(self, data: bytes) -> None:
        """Write to the shell's stdin."""

    @abc.abstractmethod
    def read_frame(self, deadline: float) -> tuple[int, bytes] | None:
        """The next (1 = stdout | 2 = stderr, payload), or None once the shell's output ended. TimeoutError
        after `deadline` (time.monotonic) with the frame incomplete; the stream stays usable."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Can `read_frame` return something (a frame, or the end) without waiting?"""

    @abc.abstractmethod
    def kill(self) -> None:
        """From the host: kill the shell and every process still attached to its stdio."""

    @abc.abstractmethod
    def exit_code(self) -> int:
        """Once its output ended: the shell's exit status (128 + N for signal N), -1 when unknown."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close this process's end of the connection (the shell sees its stdin end)."""


class LiveFiles(abc.ABC):
    """A running sandbox's files read and written from the host without starting a command in it (how
    `agentenv serve` follows the outputs of the processes it started). Paths are absolute in the sandbox.
    `SandboxBackend.live_files` gives one where the host cannot reach the files itself."""

    @abc.abstractmethod
    def read_many(self, offsets: Mapping[str, int], limit: int) -> dict[str, tuple[int, bytes] | None]:
        """For each path, read in the order given: (its size, its bytes from the offset, at most `limit`),
        None when it is missing."""

    @abc.abstractmethod
    def write(self, path: str, data: bytes) -> None:
        """Create or replace a file."""

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """The names in a directory; FileNotFoundError when there is none."""

    @abc.abstractmethod
    def write_fifo(self, path: str, data: bytes, timeout_s: float) -> None:
        """Write into a named pipe without blocking on it: FileNotFoundError (no pipe), ConnectionRefusedError
        (no reader), BrokenPipeError (the reader closed it), TimeoutError (not read within `timeout_s`)."""

    @abc.abstractmethod
    def tree_usage(self, path: str) -> tuple[int, int]:
        """(bytes of the files below `path`, size of the file system holding it)."""

    def start_detached(self, base: str, tag: str, argv: Sequence[str], env: Mapping[str, str], cwd: str,
                       stdin: bool) -> int | None:
        """Start `argv` detached as `agentenv serve`'s launcher script does (agentenv/server/procs.py: the
        folder `<base>/t.<tag>`, its files and the link `<base>/p.<pid>`); its PID. None: this sandbox has
        no faster way than that script."""
        return None


@dataclass(frozen=True)
class ContainerSpec:
    """What a sandbox's container is made of."""

    sandbox_id: str
    image: str          # a local Docker tag
    user: str           # 'agent' or 'root' (already resolved from 'auto')
    config: SandboxConfig
    labels: Mapping[str, str]
    name: str = ""      # the container's name (its volume's: name + "-ws"); default agentenv-<sandbox id>


@dataclass(frozen=True)
class ContainerRef:
    """Handle of a sandbox's container and the volume holding its work dir."""

    container: str
    volume: str


@dataclass(frozen=True)
class Checkpoint:
    """A CRIU image of a stopped container, and the marker that proves a restore used it."""

    id: str
    path: str
    bytes: int
    marker: str
    duration_s: float


@dataclass(frozen=True)
class Settled:
    """How a sandbox whose last state move may have died halfway ends, as its runtime reads the container
    and the checkpoint store (`SandboxBackend.settle`)."""

    state: str | None                      # "running" or "paused"; None: nothing left to run or resume
    checkpoint: Checkpoint | None = None   # paused in this checkpoint, which the registry does not know yet
    drop_checkpoint: bool = False          # a resume finished with the registry's checkpoint: forget it
    note: str = ""                         # "paused", "rolled back", "resumed", or why nothing is left


@dataclass(frozen=True)
class ContainerState:
    running: bool
    exit_code: int | None
    oom_killed: bool
    error: str


@dataclass(frozen=True)
class ResourceSample:
    """What a running sandbox holds beyond its processes' memory (`SandboxBackend.sample`)."""

    page_cache_bytes: int   # file pages charged to its memory cgroup (0 where it has none on the host)
    disk_used_bytes: int    # bytes of the files in its work dir
    disk_total_bytes: int   # size of the file system holding its work dir


@dataclass(frozen=True)
class HostProbe:
    """What this host's CRIU can do (probed once and cached; see `SandboxBackend.probe`)."""

    can_checkpoint_other_uids: bool
    detail: str

    @property
    def auto_user(self) -> str:
        return "agent" if self.can_checkpoint_other_uids else "root"


class SandboxBackend(abc.ABC):
    """Containers with checkpoint/restore. Methods are safe to call from several threads at once
    for different containers; callers serialise state changes of one container."""

    name: str = "abstract"
    restores_into_running = False  # a restore can go into a started container (spare shells for forks)

    @abc.abstractmethod
    def probe(self, image: str, refresh: bool = False) -> HostProbe:
        """Can CRIU here checkpoint a process of a non-root uid? (cached per boot and runtime version)"""

    @abc.abstractmethod
    def resolve_image(self, image: str) -> str:
        """An `agentenv images` name or Docker tag -> a Docker tag that exists locally."""

    @abc.abstractmethod
    def create(self, spec: ContainerSpec) -> ContainerRef:
        """Create and start a fresh container (with its own work-dir volume)."""

    @abc.abstractmethod
    def exec(self, ref: ContainerRef, argv: Sequence[str], *, user: str, timeout_s: float,
             output_limit: int, stdin: bytes | None = None, env: Mapping[str, str] | None = None,
             workdir: str | None = None) -> RawExec:
        """Run argv inside; the timeout kills its whole process group; outputs are capped."""

    @abc.abstractmethod
    def open_shell(self, ref: ContainerRef, *, user: str) -> ShellStream:
        """Start a shell (`SHELL_ARGV`) in the running container, reading commands from its stdin (a
        session's shell). ContainerNotRunning when the container is gone or stopped."""

    @abc.abstractmethod
    def end_shells(self, ref: ContainerRef) -> int:
        """Kill every session shell in the container, whichever process opened it, with everything still
        attached to its stdio (which no checkpoint can carry); returns how many."""

    @abc.abstractmethod
    def checkpoint(self, ref: ContainerRef, checkpoint_id: str, *, user: str) -> Checkpoint:
        """Dump every process of the container to local disk and stop it (no process, no memory)."""

    @abc.abstractmethod
    def restore(self, ref: ContainerRef, checkpoint: Checkpoint, *, sandbox_id: str) -> None:
        """Restore the container from its checkpoint; verify it really restored (else CheckpointError)."""

    @abc.abstractmethod
    def fork_files(self, source: ContainerRef, spec: ContainerSpec) -> ContainerRef:
        """A new container, not started, holding a copy of the stopped source's files (its work dir, and
        its writable root unless read-only): a fork once `restore` brings a checkpoint's memory into it."""

    def new_container(self, spec: ContainerSpec) -> ContainerRef:
        """A new container, not started, with an empty work dir: a moved sandbox once its files are unpacked
        into `sandbox_files` and `restore` brings its checkpoint's memory into it."""
        raise NotImplementedError(f"the {self.name} backend takes in no moved sandboxes")

    def sandbox_files(self, ref: ContainerRef, *, rootfs: bool) -> dict[str, Path]:
        """Host folders holding a sandbox's files: its work dir ("workdir") and, with `rootfs`, its writable
        root layer ("rootfs"), which a fork copies and a move packs and unpacks."""
        raise NotImplementedError(f"the {self.name} backend has no sandbox files on this host")

    def live_files(self, ref: ContainerRef) -> LiveFiles | None:
        """The running sandbox's files for the host to read and write, or None where the host reaches them
        itself (a container's root through its init, `container_root`)."""
        return None

    def container_root(self, ref: ContainerRef) -> Path:
        """The running container's file system as the host sees it (`/proc/<its init>/root`), where
        `live_files` is None; ContainerNotRunning when it is gone or stopped."""
        raise NotImplementedError(f"the {self.name} backend's sandboxes have no root on this host")

    def loopback_listener(self, ref: ContainerRef, port: int) -> socket.socket:
        """A TCP socket listening on 127.0.0.1:`port` inside the running sandbox's network namespace and held
        by the caller: the sandbox's processes connect to it, and since none of them holds it, a pause
        neither dumps nor keeps it. ContainerNotRunning when the sandbox is gone or stopped."""
        raise NotImplementedError(f"the {self.name} backend's sandboxes have no network namespace on this "
                                  "host")

    def network_namespace(self, ref: ContainerRef) -> int | None:
        """The id of the running sandbox's network namespace (a restore or fork that makes a new one gives
        another id; a listener of the old one is then out of the sandbox's reach), None when it has none."""
        return None

    def workdir_on_host(self, ref: ContainerRef, workdir: str) -> Path | None:
        """The host folder that is the running sandbox's work dir `workdir` (its volume: the host can watch
        it), or None when there is none (not running, gone, or a file system only the sandbox sees)."""
        return None

    def sample(self, ref: ContainerRef, workdir: str) -> ResourceSample:
        """The running sandbox's page cache and the disk use of its work dir `workdir` (zeros when it is not
        running). This default counts the work dir through `live_files`, with no page cache."""
        files = self.live_files(ref)
        if files is None:
            raise NotImplementedError(f"the {self.name} backend samples no sandbox")
        return ResourceSample(0, *files.tree_usage(workdir))

    def daemon_pids(self) -> list[int]:
        """Host PIDs of the daemons that run this backend's containers, dumps and restores (their cgroups
        hold the CPU those cost, `agentenv.pool.cpu`); [] when the work runs in the callers' processes."""
        return []

    def fork_into(self, source: ContainerRef, ref: ContainerRef) -> None:
        """Copy the stopped source's work dir into another sandbox's container made ahead (a spare shell of
        a read-only-root template): a fork once `restore` brings a checkpoint's memory into it."""
        raise NotImplementedError(f"the {self.name} backend makes no spare shells")

    @abc.abstractmethod
    def discard_checkpoint(self, ref: ContainerRef, checkpoint: Checkpoint) -> None:
        """Delete a checkpoint's images from disk."""

    @abc.abstractmethod
    def freeze(self, ref: ContainerRef) -> None:
        """Freeze every process of the running container (cgroup freezer, `docker pause`): no CPU, its
        memory kept; a frozen container takes no exec until `thaw`."""

    @abc.abstractmethod
    def thaw(self, ref: ContainerRef) -> None:
        """Let a frozen container's processes run again (`docker unpause`)."""

    @abc.abstractmethod
    def remove(self, ref: ContainerRef) -> None:
        """Kill and delete the container and its volume (idempotent)."""

    @abc.abstractmethod
    def state(self, ref: ContainerRef) -> ContainerState | None:
        """The container's runtime state, or None when it no longer exists."""

    @abc.abstractmethod
    def usage(self, ref: ContainerRef) -> tuple[int, float, int, int]:
        """(rss_bytes, cpu_seconds since last start, pids, oom_kills since last start); zeros when stopped."""

    @abc.abstractmethod
    def describe(self) -> dict[str, object]:
        """Facts about the runtime for `agentenv info` (versions, features)."""

    @abc.abstractmethod
    def settle(self, ref: ContainerRef, sandbox_id: str, recorded: str, checkpoint: Checkpoint | None,
               wait_s: float) -> Settled:
        """Where a sandbox the registry records as `recorded` ("running" or "paused", with its latest
        `checkpoint`) really is, when the process that last moved its state may have died halfway: a dump
        still running is waited for (at most `wait_s`); a pause whose dump finished ends paused, one that
        did not ends running; a resume whose checkpoint is intact is rolled back, else it ends running.
        The caller holds the sandbox's lock and applies the answer to the registry."""

    @abc.abstractmethod
    def dump_in_progress(self, ref: ContainerRef) -> bool:
        """Does a dump of the container run on this host now (whoever started it)?"""

    @abc.abstractmethod
    def drop_leftovers(self, ref: ContainerRef, keep: Checkpoint | None) -> list[str]:
        """Delete what dead state moves left in the store for the container (never `keep`); the paths."""

    def collect_leftovers(self, dry_run: bool = False, older_than_s: float = 600.0) -> list[str]:
        """Delete files the runtime left behind from old restores; returns what was (or would be) removed."""
        return []

    @abc.abstractmethod
    def sandbox_of_container(self, container: str) -> str | None:
        """The sandbox id a container was made for (its label), or None."""

    @abc.abstractmethod
    def list_owned(self, home: str) -> dict[str, list[str]]:
        """{'containers': [...], 'volumes': [...]} labelled as belonging to the registry at `home`."""

    def find(self, labels: Mapping[str, str], *, running_only: bool = False) -> dict[str, list[str]]:
        """The containers and volumes carrying every one of `labels`, as `list_owned` gives them; with
        `running_only`, only running containers and no volumes. `labels` must hold `LABEL_HOME` and may
        hold `LABEL_SANDBOX`: this default reads `list_owned`, `sandbox_of_container` and `state` (a
        volume is found by its home only, never by its sandbox)."""
        home, sandbox = labels.get(LABEL_HOME), labels.get(LABEL_SANDBOX)
        other = sorted(set(labels) - {LABEL_HOME, LABEL_SANDBOX})
        if home is None or other:
            raise NotImplementedError(f"the {self.name} backend finds containers by {LABEL_HOME} (and "
                                      f"{LABEL_SANDBOX}) only, not by {other or 'these labels'}")
        owned = self.list_owned(home)
        containers = [c for c in owned["containers"]
                      if sandbox is None or self.sandbox_of_container(c) == sandbox]
        if running_only:
            containers = [c for c in containers if (st := self.state(ContainerRef(c, ""))) and st.running]
        volumes = [] if running_only or sandbox is not None else list(owned["volumes"])
        return {"containers": containers, "volumes": volumes}


class ContainerNotRunning(Exception):
    """Internal: the container is gone or stopped (the Sandbox layer decides what state that means)."""
