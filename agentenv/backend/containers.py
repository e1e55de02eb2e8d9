"""Sandbox containers on Docker: create, exec, identity, state, usage, removal, and the uid probe.

`DockerContainers` is the container half of the one runtime (`runtime.CriuRuntime` adds checkpoint, restore
and fork); each container is made so that CRIU can dump and restore it (no TTY, no host-mounted init, a
dumped tmpfs at /run/agentenv). Needs root on the Docker host.

Design: docs/design/sandboxes.md#agentenv-backend-containers.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import docker

from agentenv.backend import docker_client, images, netns, runtime_files
from agentenv.backend.base import (
    LABEL_HOME,
    LABEL_SANDBOX,
    RUNTIME_DIR,
    SHELL_ARGV,
    UIDS,
    ContainerNotRunning,
    ContainerRef,
    ContainerSpec,
    ContainerState,
    HostProbe,
    RawExec,
    ResourceSample,
    SandboxBackend,
    ShellStream,
)
from agentenv.backend.cgroups import page_cache_bytes, read_usage
from agentenv.backend.docker_client import docker_errors, first_line
from agentenv.backend.docker_exec import DockerShell, kill_attached, run_exec, start_exec
from agentenv.backend.files import tree_bytes
from agentenv.backend.procs import pids_named
from agentenv.errors import AgentEnvError, BackendUnavailable, CheckpointError
from agentenv.locks import sandbox_lock
from agentenv.owner import start_ticks, still_running

LABEL_PROBE = "org.k3rl.agentenv.probe"
# PID 1 of every sandbox: sleeps forever, reaps orphaned children (dash's `wait` reaps any child),
# exits on TERM.
INIT_ARGV = ["sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep infinity & wait $!; done"]
RUNTIME_TMPFS = "size=64k,mode=755"
CAP_SYS_RESOURCE = 24
RUNTIME_DAEMONS = ("dockerd", "containerd")  # the host processes that run containers, dumps and restores
MAX_COUNTED_FILES = 100_000  # `sample`: a work dir with more files is counted this far (bounds one call)


def cap_sys_resource_in_bounding_set(pid: int | str = "self") -> bool:
    """Does process `pid` keep CAP_SYS_RESOURCE in its bounding set? CRIU needs it (as root on the host)
    to read and set the rlimits of a process that belongs to another uid."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("CapBnd:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return True


@contextlib.contextmanager
def _exec_errors() -> Iterator[None]:
    """A docker exec's errors: the container gone or stopped (404, 409) is ContainerNotRunning (the Sandbox
    layer decides what state that means), any other refusal an AgentEnvError naming it."""
    try:
        yield
    except docker.errors.NotFound as e:
        raise ContainerNotRunning(f"its container is gone ({first_line(e)})") from None
    except docker.errors.APIError as e:
        if e.status_code == 409:
            raise ContainerNotRunning(first_line(e)) from None
        raise AgentEnvError(f"docker exec failed: {first_line(e)}") from None


class DockerContainers(SandboxBackend):
    """Containers through Docker's API; subclasses add checkpoint/restore (`_dump` is theirs)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._root: Path | None = None
        self._experimental: bool | None = None
        self._probe: HostProbe | None = None
        self._lock = threading.Lock()
        self._inits: dict[str, tuple[int, str]] = {}  # container -> its init's (host pid, start ticks)

    @property
    def api(self) -> docker.APIClient:
        return docker_client.api()

    # ---- host facts -------------------------------------------------------------------------------
    @docker_errors
    def docker_root(self) -> Path:
        """Docker's data dir (checkpoints and volumes live there); we must be able to write it."""
        if self._root is None:
            root = Path(self.api.info()["DockerRootDir"])
            if not os.access(root, os.W_OK | os.X_OK):
                raise BackendUnavailable(
                    f"the docker-criu backend needs root on the Docker host: it cannot write {root} "
                    "(run agentenv as root on the machine that runs dockerd)"
                )
            self._root = root
        return self._root

    def _require_experimental(self) -> None:
        if self._experimental is None:
            self._experimental = bool(self.api.version().get("Experimental"))
        if not self._experimental:
            raise BackendUnavailable(
                "the Docker daemon runs without experimental features, so it cannot checkpoint; restart it "
                "as `dockerd --experimental` (scripts/ensure_dockerd.sh does)"
            )

    @docker_errors
    def describe(self) -> dict[str, object]:
        version = self.api.version()
        return {"docker": version.get("Version"), "experimental": bool(version.get("Experimental")),
                "docker_root": str(self.docker_root())}

    @docker_errors
    def probe(self, image: str, refresh: bool = False) -> HostProbe:
        """Try to checkpoint a uid-1000 process once; cache the answer per boot and Docker version."""
        with self._lock:
            if self._probe is not None and not refresh:
                return self._probe
        cache = self.home / "host-probe.json"
        key = {
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "docker": self.api.version().get("Version", "?"),
        }
        with sandbox_lock(self.home / "locks", "host-probe", timeout_s=120, action="probe"):
            cached = None
            with contextlib.suppress(OSError, ValueError):
                cached = json.loads(cache.read_text())
            if not refresh and cached and cached.get("key") == key:
                result = HostProbe(cached["can_checkpoint_other_uids"], cached["detail"])
            else:
                result = self._probe_checkpoint_other_uid(image)
                cache.write_text(json.dumps({"key": key, "can_checkpoint_other_uids":
                                             result.can_checkpoint_other_uids, "detail": result.detail}))
        with self._lock:
            self._probe = result
        return result

    def _probe_checkpoint_other_uid(self, image: str) -> HostProbe:
        self._require_experimental()
        hc = self.api.create_host_config(network_mode="none", cap_drop=["ALL"], read_only=True,
                                         security_opt=["no-new-privileges:true"], pids_limit=16,
                                         mem_limit=64 * 1024**2)
        cid = self.api.create_container(image, command=["sleep", "infinity"], user=UIDS["agent"],
                                        host_config=hc, network_disabled=True,
                                        name=f"agentenv-probe-{secrets.token_hex(4)}",
                                        labels={LABEL_HOME: str(self.home), LABEL_PROBE: "1"})["Id"]
        try:
            self.api.start(cid)
            try:
                self._probe_dump(cid)
                return HostProbe(True, "CRIU checkpoints processes of uid 1000: sandboxes run as user agent")
            except CheckpointError as e:
                cap = "" if cap_sys_resource_in_bounding_set() else (
                    " (root here lacks CAP_SYS_RESOURCE in its capability bounding set)")
                return HostProbe(False, "CRIU cannot checkpoint processes of another uid on this host"
                                 f"{cap}, so sandboxes run as root without any capability: {e}")
        finally:
            with contextlib.suppress(docker.errors.APIError):
                self.api.remove_container(cid, force=True)

    @abc.abstractmethod
    def _probe_dump(self, container: str) -> None:
        """Checkpoint the running probe container the way pauses do (then drop the images); raise
        CheckpointError with CRIU's reason when it cannot."""

    @docker_errors
    def resolve_image(self, image: str) -> str:
        return images.resolve(image)

    # ---- lifecycle ----------------------------------------------------------------------------
    def _host_config(self, spec: ContainerSpec, volume: str) -> dict:
        c = spec.config
        tmpfs = dict(c.tmpfs)
        tmpfs[RUNTIME_DIR] = RUNTIME_TMPFS
        return self.api.create_host_config(
            network_mode=c.network,
            cap_drop=list(c.cap_drop) or None,
            cap_add=list(c.cap_add) or None,
            security_opt=["no-new-privileges:true"] if c.no_new_privileges else None,
            read_only=c.read_only,
            tmpfs=tmpfs,
            mounts=[docker.types.Mount(c.workspace, volume, type="volume", no_copy=True),
                    *self._runtime_mounts()],
            pids_limit=c.pids_limit,
            mem_limit=c.memory_bytes,
            memswap_limit=c.memory_bytes,
            nano_cpus=int(c.cpus * 1e9),
        )

    def _init_argv(self) -> tuple[list[str] | None, list[str]]:
        """(entrypoint, command) of every new container: the init that runs as its PID 1."""
        return None, INIT_ARGV

    def _runtime_mounts(self) -> list[docker.types.Mount]:
        """Host files every new container gets read-only (none here; the warm runtime's init)."""
        return []

    def _new_container(self, spec: ContainerSpec) -> ContainerRef:
        """Volume (owned by the sandbox user) + created, not started, container."""
        labels = {**spec.labels, LABEL_SANDBOX: spec.sandbox_id}
        name = spec.name or f"agentenv-{spec.sandbox_id}"
        volume = f"{name}-ws"
        self.api.create_volume(volume, labels=labels)
        ref = ContainerRef(container="", volume=volume)
        try:
            data = Path(self.api.inspect_volume(volume)["Mountpoint"])
            uid, gid = (int(x) for x in UIDS[spec.user].split(":"))
            os.chown(data, uid, gid)
            os.chmod(data, 0o755)
            entrypoint, command = self._init_argv()
            cid = self.api.create_container(
                spec.image, command=command, entrypoint=entrypoint, user=UIDS[spec.user],
                name=name,
                environment={"HOME": spec.config.workspace}, working_dir=spec.config.workspace,
                labels=labels, host_config=self._host_config(spec, volume), hostname="sandbox",
                tty=False, stdin_open=False, network_disabled=spec.config.network == "none",
            )["Id"]
        except BaseException:
            self.remove(ref)
            raise
        return ContainerRef(container=cid, volume=volume)

    @docker_errors
    def create(self, spec: ContainerSpec) -> ContainerRef:
        ref = self._new_container(spec)
        try:
            self.api.start(ref.container)
            self._write_identity(ref, spec.sandbox_id)
        except BaseException:
            self.remove(ref)
            raise
        return ref

    def _runtime_files(self, ref: ContainerRef, writes: dict[str, str], read: str | None = None, *,
                       pid: int | None = None) -> str:
        """`runtime_files.exchange` in the container's runtime dir (its init process's view); `pid`: the
        init's host PID when the caller has just inspected the container (else it is looked up)."""
        if pid is None:
            pid = int(self.api.inspect_container(ref.container)["State"].get("Pid") or 0)
        if not pid:
            raise ContainerNotRunning("its container has no process")
        try:
            return runtime_files.exchange(pid, writes, read)
        except OSError as e:
            raise ContainerNotRunning(f"cannot write {RUNTIME_DIR} in the container: {e}") from None

    def _write_identity(self, ref: ContainerRef, sandbox_id: str, *, pid: int | None = None) -> str:
        """Write sandbox-id and a fresh seed into /run/agentenv; return the restore marker found there."""
        return self._runtime_files(ref, {"sandbox-id": sandbox_id, "seed": str(secrets.randbits(63))},
                                   read="marker", pid=pid)

    @docker_errors
    def exec(self, ref: ContainerRef, argv: Sequence[str], *, user: str, timeout_s: float,
             output_limit: int, stdin: bytes | None = None, env: Mapping[str, str] | None = None,
             workdir: str | None = None) -> RawExec:
        with _exec_errors():
            return run_exec(self.api, ref.container, argv, user=UIDS[user], timeout_s=timeout_s,
                            output_limit=output_limit, stdin=stdin, env=env, workdir=workdir)

    @docker_errors
    def open_shell(self, ref: ContainerRef, *, user: str) -> ShellStream:
        with _exec_errors():
            exec_id, stream = start_exec(self.api, ref.container, SHELL_ARGV, user=UIDS[user], stdin=True)
        return DockerShell(exec_id, stream)

    @docker_errors
    def end_shells(self, ref: ContainerRef) -> int:
        try:
            info = self.api.inspect_container(ref.container)
        except docker.errors.NotFound:
            return 0
        exec_ids, init_pid = info.get("ExecIDs") or [], int(info["State"].get("Pid") or 0)
        pids = []
        for exec_id in exec_ids:
            try:
                info = self.api.exec_inspect(exec_id)
            except docker.errors.NotFound:
                continue  # it ended meanwhile
            pc = info.get("ProcessConfig") or {}
            if info.get("Running") and (pc.get("entrypoint"), *(pc.get("arguments") or ())) == SHELL_ARGV:
                pids.append(int(info.get("Pid") or 0))
        pids = [p for p in pids if p > 0]
        if pids:
            kill_attached(pids, init_pid)
        return len(pids)

    @docker_errors
    def freeze(self, ref: ContainerRef) -> None:
        self.api.pause(ref.container)

    @docker_errors
    def thaw(self, ref: ContainerRef) -> None:
        self.api.unpause(ref.container)

    @docker_errors
    def remove(self, ref: ContainerRef) -> None:
        if ref.container:
            self._inits.pop(ref.container, None)
            with contextlib.suppress(docker.errors.NotFound):
                self.api.remove_container(ref.container, force=True)
        if ref.volume:
            for attempt in range(5):
                try:
                    self.api.remove_volume(ref.volume, force=True)
                    break
                except docker.errors.NotFound:
                    break
                except docker.errors.APIError:  # still in use while the container goes away
                    if attempt == 4:
                        raise
                    time.sleep(0.2)

    # ---- inspection ----------------------------------------------------------------------------
    @docker_errors
    def state(self, ref: ContainerRef) -> ContainerState | None:
        try:
            s = self.api.inspect_container(ref.container)["State"]
        except docker.errors.NotFound:
            return None
        return ContainerState(running=bool(s.get("Running")), exit_code=s.get("ExitCode"),
                              oom_killed=bool(s.get("OOMKilled")), error=s.get("Error") or "")

    @docker_errors
    def usage(self, ref: ContainerRef) -> tuple[int, float, int, int]:
        try:
            pid = self._init_pid(ref)
        except ContainerNotRunning:
            return (0, 0.0, 0, 0)
        u = read_usage(pid)
        return (u.rss_bytes, u.cpu_seconds, u.pids, u.oom_kills)

    def _running_init(self, ref: ContainerRef) -> tuple[dict[str, Any], int]:
        """(the running container's inspect data, its init's host PID); ContainerNotRunning else."""
        try:
            info = self.api.inspect_container(ref.container)
        except docker.errors.NotFound:
            raise ContainerNotRunning("its container is gone") from None
        pid = int(info["State"].get("Pid") or 0)
        if not info["State"].get("Running") or pid <= 0:
            raise ContainerNotRunning("its container is not running")
        return info, pid

    def _init_pid(self, ref: ContainerRef) -> int:
        """The running container's init's host PID; ContainerNotRunning else. Docker is asked once per init
        process: its answer is kept with the process's start time, and while that process runs (same PID,
        same start time, not a zombie) the container does, so an episode's calls make no API round trip."""
        known = self._inits.get(ref.container or "")
        if known is not None and still_running(*known):
            return known[0]
        pid = self._running_init(ref)[1]
        if (ticks := start_ticks(pid)) is not None and ref.container:
            self._inits[ref.container] = (pid, ticks)
        return pid

    @docker_errors
    def container_root(self, ref: ContainerRef) -> Path:
        return Path(f"/proc/{self._init_pid(ref)}/root")

    @docker_errors
    def loopback_listener(self, ref: ContainerRef, port: int) -> socket.socket:
        return netns.listen_on_loopback(self._init_pid(ref), port)

    @docker_errors
    def network_namespace(self, ref: ContainerRef) -> int | None:
        try:
            return netns.netns_id(self._init_pid(ref))
        except (ContainerNotRunning, FileNotFoundError, ProcessLookupError):
            return None

    @staticmethod
    def _workdir_mount(info: dict[str, Any], workdir: str) -> str | None:
        """The host folder mounted at `workdir` (the work-dir volume's), from the container's inspect data."""
        ws = workdir.rstrip("/")
        return next((m["Source"] for m in info.get("Mounts") or []
                     if m.get("Destination", "").rstrip("/") == ws and m.get("Source")), None)

    @docker_errors
    def workdir_on_host(self, ref: ContainerRef, workdir: str) -> Path | None:
        try:
            source = self._workdir_mount(self._running_init(ref)[0], workdir)
        except ContainerNotRunning:
            return None
        return Path(os.path.realpath(source)) if source else None

    @docker_errors
    def sample(self, ref: ContainerRef, workdir: str) -> ResourceSample:
        try:
            info = self.api.inspect_container(ref.container)
        except docker.errors.NotFound:
            return ResourceSample(0, 0, 0)
        cache = page_cache_bytes(int(info["State"].get("Pid") or 0))  # 0 without a process
        mount = self._workdir_mount(info, workdir)
        if not mount:
            return ResourceSample(cache, 0, 0)
        used = tree_bytes(Path(mount), MAX_COUNTED_FILES)
        return ResourceSample(cache, used, shutil.disk_usage(mount).total)

    def daemon_pids(self) -> list[int]:
        return pids_named(*RUNTIME_DAEMONS)

    @docker_errors
    def find(self, labels: Mapping[str, str], *, running_only: bool = False) -> dict[str, list[str]]:
        if not labels:  # Docker's filter would match every container on the daemon, other homes' too
            raise ValueError("find needs at least one label to match")
        flt: dict[str, Any] = {"label": [f"{k}={v}" for k, v in labels.items()]}
        if running_only:
            flt["status"] = "running"
        containers = [c["Id"] for c in self.api.containers(all=not running_only, filters=flt)]
        volumes = [] if running_only else [
            v["Name"] for v in (self.api.volumes(filters={"label": flt["label"]}).get("Volumes") or [])]
        return {"containers": containers, "volumes": volumes}

    def list_owned(self, home: str) -> dict[str, list[str]]:
        return self.find({LABEL_HOME: home})

    @docker_errors
    def sandbox_of_container(self, container: str) -> str | None:
        try:
            return self.api.inspect_container(container)["Config"]["Labels"].get(LABEL_SANDBOX)
        except docker.errors.NotFound:
            return None
