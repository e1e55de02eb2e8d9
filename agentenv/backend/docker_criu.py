"""The Docker + CRIU backend: containers run by Docker (runc), paused with Docker's experimental
checkpoint API (CRIU dumps every process to disk and the container stops), resumed with
`start --checkpoint`, and forked by restoring one checkpoint into new containers.

Facts this backend is built around (Docker 20.10, CRIU 4.1; see docs/agentenv.md):
- `start --checkpoint-dir` is refused, so a fork copies (hard-links) the checkpoint into the new
  container's own checkpoints folder under Docker's root dir (local disk) and restores from there.
- CRIU images hold no filesystem: the work-dir volume is copied while the source is stopped, and with
  `read_only: false` the container's writable layer (overlay upper dir) is copied as well. tmpfs mounts
  are part of the dump.
- Docker may report a successful restore while starting the container afresh. Before every dump a
  random marker is written into a root-owned tmpfs (/run/agentenv, dumped with the processes); after
  every restore it must be there, or the restore failed (CheckpointError).
- Docker uploads a checkpoint into containerd for every restore; a nonce file makes each upload unique
  (an identical blob left by `checkpoint create` fails the commit) and lets us delete the copy containerd
  unpacks into its TMPDIR and never removes (containerd #10166).
- The container's init is a POSIX `sh` loop that reaps orphans (docker's `--init` binary is a host bind
  mount that breaks restores into another container), never a TTY (CRIU cannot dump one).
This backend needs root on the Docker host: it reads cgroups and Docker's data directory directly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import docker
import requests

from agentenv.backend import docker_client
from agentenv.backend.base import (
    LABEL_HOME,
    LABEL_SANDBOX,
    RUNTIME_DIR,
    UIDS,
    Checkpoint,
    ContainerNotRunning,
    ContainerRef,
    ContainerSpec,
    ContainerState,
    HostProbe,
    RawExec,
    SandboxBackend,
)
from agentenv.backend.cgroups import read_usage
from agentenv.backend.docker_exec import run_exec
from agentenv.errors import AgentEnvError, BackendUnavailable, CheckpointError
from agentenv.locks import sandbox_lock

LABEL_PROBE = "org.k3rl.agentenv.probe"
# PID 1 of every sandbox: sleeps forever, reaps orphaned children (dash's `wait` reaps any child),
# exits on TERM.
INIT_ARGV = ["sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep infinity & wait $!; done"]
RUNTIME_TMPFS = "size=64k,mode=755"
RESTORE_NONCE_FILE = "agentenv-restore-nonce"
CAP_SYS_RESOURCE = 24

T = TypeVar("T")


def _docker_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn "cannot reach the daemon" into BackendUnavailable; leave other errors alone."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except (requests.exceptions.ConnectionError, ConnectionRefusedError, FileNotFoundError) as e:
            if isinstance(e, FileNotFoundError) and "docker.sock" not in str(e):
                raise
            docker_client.reset()
            raise docker_client.unavailable(e) from None

    return wrapper


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


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _criu_log_errors(message: str, limit: int = 3) -> str:
    """The last `Error` lines of the CRIU log that Docker's error message names (if it still exists)."""
    m = re.search(r"(?:path=|log file:)\s*(\S+\.log)", message)
    if not m:
        return ""
    try:
        lines = Path(m.group(1)).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln.split(": ", 1)[-1].strip() for ln in lines if "Error" in ln]
    return "; CRIU says: " + " | ".join(errors[-limit:]) if errors else ""


def _first_line(e: docker.errors.APIError) -> str:
    return str(e.explanation or e).strip().splitlines()[0]


def _copy_tree(src: Path, dst: Path, hardlink: bool = False) -> None:
    """cp -a (xattrs, owners, device nodes such as overlay whiteouts); -l hard-links instead of copying."""
    dst.mkdir(parents=True, exist_ok=True)
    flags = ["-a", "-l"] if hardlink else ["-a", "--reflink=auto"]
    proc = subprocess.run(["cp", *flags, f"{src}/.", f"{dst}/"], capture_output=True, text=True)
    if proc.returncode != 0 and hardlink:  # other filesystem: copy instead
        proc = subprocess.run(["cp", "-a", f"{src}/.", f"{dst}/"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CheckpointError(f"copying {src} to {dst} failed: {proc.stderr.strip()[:300]}")


def drop_host_clock_image(checkpoint_dir: Path) -> None:
    """Make the restore keep the host's time namespace (docs/agentenv.md, "Clocks"):
    with the clock image, CRIU restores into a new time namespace that later `docker exec` processes
    do not join, and the next restore of such a tree fails ("Can't restore sub-task in NS")."""
    (checkpoint_dir / "timens-0.img").unlink(missing_ok=True)


def containerd_tmp_dirs() -> list[Path]:
    """Where the running containerd processes unpack checkpoints ($TMPDIR of each, default /tmp)."""
    dirs: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (proc / "comm").read_text().strip() != "containerd":
                continue
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
            dirs.add(Path(env.get("TMPDIR") or "/tmp"))
    return sorted(dirs) or [Path("/tmp")]


def remove_containerd_copies(nonce: str | None = None, older_than_s: float | None = None,
                             dry_run: bool = False) -> list[str]:
    """Delete the copies of our checkpoints that containerd unpacks for every restore and never removes
    (`<tmp>/ctrd-checkpoint*`, containerd #10166; each is as big as the checkpoint). Ours carry the
    restore nonce file: with `nonce`, the copy of that restore; with `older_than_s`, every stale one."""
    removed = []
    now = time.time()
    for tmp in containerd_tmp_dirs():
        for copy in tmp.glob("ctrd-checkpoint*"):
            marker = copy / RESTORE_NONCE_FILE
            try:
                if nonce is not None and marker.read_text() != nonce:
                    continue
                if older_than_s is not None and now - marker.stat().st_mtime < older_than_s:
                    continue
            except OSError:
                continue
            if not dry_run:
                shutil.rmtree(copy, ignore_errors=True)
            removed.append(str(copy))
    return removed


class DockerCriuBackend(SandboxBackend):
    name = "docker-criu"

    def __init__(self, home: Path) -> None:
        self.home = home
        self._root: Path | None = None
        self._experimental: bool | None = None
        self._probe: HostProbe | None = None
        self._lock = threading.Lock()

    @property
    def api(self) -> docker.APIClient:
        return docker_client.api()

    # ---- host facts -------------------------------------------------------------------------------
    @_docker_errors
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

    @_docker_errors
    def describe(self) -> dict[str, object]:
        version = self.api.version()
        return {"docker": version.get("Version"), "experimental": bool(version.get("Experimental")),
                "docker_root": str(self.docker_root())}

    @_docker_errors
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
                                        host_config=hc, name=f"agentenv-probe-{secrets.token_hex(4)}",
                                        labels={LABEL_HOME: str(self.home), LABEL_PROBE: "1"})["Id"]
        try:
            self.api.start(cid)
            try:
                self._checkpoint_call(cid, "probe")
                return HostProbe(True, "CRIU checkpoints processes of uid 1000: sandboxes run as user agent")
            except docker.errors.APIError as e:
                why = _criu_log_errors(str(e.explanation or e)) or f": {_first_line(e)}"
                cap = "" if cap_sys_resource_in_bounding_set() else (
                    " (root here lacks CAP_SYS_RESOURCE in its capability bounding set)")
                return HostProbe(False, "CRIU cannot checkpoint processes of another uid on this host"
                                 f"{cap}, so sandboxes run as root without any capability{why}")
        finally:
            with contextlib.suppress(docker.errors.APIError):
                self.api.remove_container(cid, force=True)

    @_docker_errors
    def resolve_image(self, image: str) -> str:
        from agentenv import images

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
            mounts=[docker.types.Mount(c.workspace, volume, type="volume", no_copy=True)],
            pids_limit=c.pids_limit,
            mem_limit=c.memory_bytes,
            memswap_limit=c.memory_bytes,
            nano_cpus=int(c.cpus * 1e9),
        )

    def _new_container(self, spec: ContainerSpec) -> ContainerRef:
        """Volume (owned by the sandbox user) + created, not started, container."""
        labels = {**spec.labels, LABEL_SANDBOX: spec.sandbox_id}
        volume = f"agentenv-{spec.sandbox_id}-ws"
        self.api.create_volume(volume, labels=labels)
        ref = ContainerRef(container="", volume=volume)
        try:
            data = Path(self.api.inspect_volume(volume)["Mountpoint"])
            uid, gid = (int(x) for x in UIDS[spec.user].split(":"))
            os.chown(data, uid, gid)
            os.chmod(data, 0o755)
            cid = self.api.create_container(
                spec.image, command=INIT_ARGV, user=UIDS[spec.user], name=f"agentenv-{spec.sandbox_id}",
                environment={"HOME": spec.config.workspace}, working_dir=spec.config.workspace,
                labels=labels, host_config=self._host_config(spec, volume), hostname="sandbox",
                tty=False, stdin_open=False,
            )["Id"]
        except BaseException:
            self.remove(ref)
            raise
        return ContainerRef(container=cid, volume=volume)

    @_docker_errors
    def create(self, spec: ContainerSpec) -> ContainerRef:
        ref = self._new_container(spec)
        try:
            self.api.start(ref.container)
            self._write_identity(ref, spec.sandbox_id)
        except BaseException:
            self.remove(ref)
            raise
        return ref

    def _root_exec(self, ref: ContainerRef, script: str, *args: str) -> RawExec:
        return run_exec(self.api, ref.container, ["sh", "-c", script, "sh", *args], user=UIDS["root"],
                        timeout_s=30, output_limit=4096)

    def _write_identity(self, ref: ContainerRef, sandbox_id: str) -> str:
        """Write sandbox-id and a fresh seed into /run/agentenv; return the restore marker found there."""
        r = self._root_exec(
            ref, f'cat {RUNTIME_DIR}/marker 2>/dev/null; printf %s "$1" > {RUNTIME_DIR}/sandbox-id; '
            f'printf %s "$2" > {RUNTIME_DIR}/seed', sandbox_id, str(secrets.randbits(63)))
        if r.exit_code != 0:
            raise ContainerNotRunning(f"cannot write {RUNTIME_DIR} in the container: "
                                      f"{r.stderr.decode(errors='replace').strip()[:200]}")
        return r.stdout.decode(errors="replace").strip()

    @_docker_errors
    def exec(self, ref: ContainerRef, argv: Sequence[str], *, user: str, timeout_s: float,
             output_limit: int, stdin: bytes | None = None, env: Mapping[str, str] | None = None,
             workdir: str | None = None) -> RawExec:
        try:
            return run_exec(self.api, ref.container, argv, user=UIDS[user], timeout_s=timeout_s,
                            output_limit=output_limit, stdin=stdin, env=env, workdir=workdir)
        except docker.errors.NotFound as e:
            raise ContainerNotRunning(f"its container is gone ({_first_line(e)})") from None
        except docker.errors.APIError as e:
            if e.status_code == 409:
                raise ContainerNotRunning(_first_line(e)) from None
            raise AgentEnvError(f"docker exec failed: {_first_line(e)}") from None

    def _checkpoint_call(self, container: str, checkpoint_id: str) -> None:
        res = self.api._post_json(self.api._url("/containers/{0}/checkpoints", container),
                                  data={"CheckpointID": checkpoint_id, "Exit": True})
        self.api._raise_for_status(res)

    @_docker_errors
    def checkpoint(self, ref: ContainerRef, checkpoint_id: str, *, user: str) -> Checkpoint:
        self._require_experimental()
        marker = self._write_restore_marker(ref)
        t0 = time.perf_counter()
        try:
            self._checkpoint_call(ref.container, checkpoint_id)
        except docker.errors.APIError as e:
            why = _criu_log_errors(str(e.explanation or e)) or f": {_first_line(e)}"
            hint = self._uid_hint(ref, user)
            raise CheckpointError(f"CRIU could not checkpoint the container{why}{hint}") from None
        duration = time.perf_counter() - t0
        state = self.state(ref)
        if state is not None and state.running:
            raise CheckpointError("Docker reported a checkpoint but the container still runs")
        path = self.docker_root() / "containers" / ref.container / "checkpoints" / checkpoint_id
        drop_host_clock_image(path)
        return Checkpoint(id=checkpoint_id, path=str(path), bytes=_dir_bytes(path), marker=marker,
                          duration_s=duration)

    def _write_restore_marker(self, ref: ContainerRef) -> str:
        """A fresh random marker in the container's runtime dir, dumped with its memory: a restore that
        really restored finds it there again (see `_verify_marker`)."""
        marker = secrets.token_hex(16)
        r = self._root_exec(ref, f'printf %s "$1" > {RUNTIME_DIR}/marker', marker)
        if r.exit_code != 0:
            raise CheckpointError(f"could not write the restore marker: {r.stderr.decode(errors='replace')}")
        return marker

    def _uid_hint(self, ref: ContainerRef, user: str) -> str:
        """Why a dump of a uid-1000 sandbox failed on hosts whose CRIU cannot dump other uids ('' else)."""
        if user == "agent" and not self.probe(self.api.inspect_container(ref.container)["Image"]) \
                .can_checkpoint_other_uids:
            return ("; this host's CRIU cannot checkpoint processes of uid 1000 (see `agentenv info`): "
                    "create sandboxes with `user: auto` (root without capabilities) to pause them")
        return ""

    def _start_from(self, ref: ContainerRef, checkpoint: Checkpoint, sandbox_id: str) -> None:
        self._require_experimental()
        # Docker uploads the checkpoint folder as a tar into containerd's content store, whose commit
        # fails with "already exists" when the same bytes are still there (the blob that `checkpoint
        # create` left until containerd's next garbage collection). A fresh nonce file makes every
        # upload unique; CRIU ignores files it does not know.
        nonce, nonce_file = secrets.token_hex(16), Path(checkpoint.path) / RESTORE_NONCE_FILE
        nonce_file.unlink(missing_ok=True)  # a fork's folder is hard-linked: never write through its inode
        nonce_file.write_text(nonce)
        try:
            res = self.api._post(self.api._url("/containers/{0}/start", ref.container),
                                 params={"checkpoint": checkpoint.id})
            self.api._raise_for_status(res)
        except docker.errors.APIError as e:
            why = _criu_log_errors(str(e.explanation or e)) or f": {_first_line(e)}"
            raise CheckpointError(f"CRIU could not restore checkpoint {checkpoint.id}{why}") from None
        finally:
            remove_containerd_copies(nonce=nonce)
        self._verify_marker(ref, checkpoint, sandbox_id)

    def _verify_marker(self, ref: ContainerRef, checkpoint: Checkpoint, sandbox_id: str) -> None:
        """The restore marker written before the dump must be back (else: a fresh start, or it died)."""
        try:
            found = self._write_identity(ref, sandbox_id)
        except ContainerNotRunning as e:
            found, detail = "", str(e)
        else:
            detail = ""
        if found != checkpoint.marker:
            with contextlib.suppress(docker.errors.APIError):
                self.api.kill(ref.container)
            raise CheckpointError(
                f"Docker reported a successful restore of checkpoint {checkpoint.id}, but the container did "
                "not come back from it (its restore marker is missing: it started afresh or died"
                f"{': ' + detail if detail else ''}); the checkpoint is kept at {checkpoint.path}"
            )

    @_docker_errors
    def restore(self, ref: ContainerRef, checkpoint: Checkpoint, *, sandbox_id: str) -> None:
        self._start_from(ref, checkpoint, sandbox_id)

    @_docker_errors
    def fork(self, source: ContainerRef, checkpoint: Checkpoint, spec: ContainerSpec) -> ContainerRef:
        root = self.docker_root()
        ref = self._new_container(spec)
        try:
            self._copy_files(source, ref, copy_rootfs=not spec.config.read_only)
            dst_ck = root / "containers" / ref.container / "checkpoints" / checkpoint.id
            _copy_tree(Path(checkpoint.path), dst_ck, hardlink=True)
            try:
                self._start_from(ref, Checkpoint(checkpoint.id, str(dst_ck), checkpoint.bytes,
                                                 checkpoint.marker, 0.0), spec.sandbox_id)
            finally:
                shutil.rmtree(dst_ck, ignore_errors=True)
        except BaseException:
            self.remove(ref)
            raise
        return ref

    def _copy_files(self, source: ContainerRef, ref: ContainerRef, *, copy_rootfs: bool) -> None:
        """A fork's files: the work-dir volume and (unless read-only) the writable rootfs layer."""
        src_vol = Path(self.api.inspect_volume(source.volume)["Mountpoint"])
        dst_vol = Path(self.api.inspect_volume(ref.volume)["Mountpoint"])
        _copy_tree(src_vol, dst_vol)
        if copy_rootfs:
            src_upper = self.api.inspect_container(source.container)["GraphDriver"]["Data"]["UpperDir"]
            dst_upper = self.api.inspect_container(ref.container)["GraphDriver"]["Data"]["UpperDir"]
            _copy_tree(Path(src_upper), Path(dst_upper))

    @_docker_errors
    def discard_checkpoint(self, ref: ContainerRef, checkpoint: Checkpoint) -> None:
        path = Path(checkpoint.path)
        if self.docker_root() in path.parents:
            shutil.rmtree(path, ignore_errors=True)

    @_docker_errors
    def remove(self, ref: ContainerRef) -> None:
        if ref.container:
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
    @_docker_errors
    def state(self, ref: ContainerRef) -> ContainerState | None:
        try:
            s = self.api.inspect_container(ref.container)["State"]
        except docker.errors.NotFound:
            return None
        return ContainerState(running=bool(s.get("Running")), exit_code=s.get("ExitCode"),
                              oom_killed=bool(s.get("OOMKilled")), error=s.get("Error") or "")

    @_docker_errors
    def usage(self, ref: ContainerRef) -> tuple[int, float, int, int]:
        try:
            pid = int(self.api.inspect_container(ref.container)["State"].get("Pid") or 0)
        except docker.errors.NotFound:
            return (0, 0.0, 0, 0)
        u = read_usage(pid)
        return (u.rss_bytes, u.cpu_seconds, u.pids, u.oom_kills)

    @_docker_errors
    def list_owned(self, home: str) -> dict[str, list[str]]:
        flt = {"label": f"{LABEL_HOME}={home}"}
        containers = [c["Id"] for c in self.api.containers(all=True, filters=flt)]
        volumes = [v["Name"] for v in (self.api.volumes(filters=flt).get("Volumes") or [])]
        return {"containers": containers, "volumes": volumes}

    def collect_leftovers(self, dry_run: bool = False, older_than_s: float = 600.0) -> list[str]:
        return remove_containerd_copies(older_than_s=older_than_s, dry_run=dry_run)

    @_docker_errors
    def sandbox_of_container(self, container: str) -> str | None:
        try:
            return self.api.inspect_container(container)["Config"]["Labels"].get(LABEL_SANDBOX)
        except docker.errors.NotFound:
            return None
