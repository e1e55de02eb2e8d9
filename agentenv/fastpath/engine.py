"""`FastPath`: pause, resume and fork Docker containers at CRIU speed while Docker stays in charge.

Where Docker's own checkpoint path spends its time (measured here at 128 MiB: ~2.9 s to checkpoint,
~2.4 s to restore, vs ~0.2 s for CRIU alone): `docker checkpoint create` has containerd dump into a temp
folder, tar + hash it into the content store, and Docker untars it again into its checkpoint folder;
`docker start --checkpoint` tars + hashes it back into the content store and containerd untars a third
copy for runc (moby #40644), which it then leaves in /tmp (containerd #10166).

The fast path keeps what makes Docker's view consistent and drops the copies:

* pause = containerd's own checkpoint RPC with an image path (`ctr tasks checkpoint --exit --image-path`),
  the same call Docker makes minus the content store. The shim runs `runc checkpoint`, the task exits,
  and dockerd processes the exit event exactly as after `docker checkpoint create`: the container is
  "exited", nothing holds memory or CPU, images sit in the store on local disk.
* resume = Docker's own `start --checkpoint`, fed a checkpoint folder whose page images are symlinks
  into the store (see dockerlink.py). Docker creates the task, so it knows the container is running:
  `docker exec`, logs, stats and stop all work as after any Docker restore.
* fork(n) = n containers cloned from the checkpointed source (config, writable layer and volumes
  copied, see clone.py), restored from the same images in parallel.
* every restore is verified: CRIU's restore log of *this* start must report success and the restored
  container's init must be back with its PID and command line (Docker has reported fresh starts as
  restores before).

Not used, on purpose: lazy-pages restore (userfaultfd works on this kernel, `HostSupport.lazy_pages`) needs
`runc restore --lazy-pages` plus a page-server daemon per restore, which the containerd shim API cannot
request, so it means restoring behind containerd's and Docker's back (Docker would then believe the
container is stopped and refuse `exec`). Pre-dump needs memory dirty tracking (`HostSupport.dirty_tracking`),
which is off here.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker

from agentenv.backend.docker_criu import drop_host_clock_image
from agentenv.errors import CheckpointError, SandboxNotFound, SandboxStateError
from agentenv.fastpath import dockerlink
from agentenv.fastpath.clone import clone_container, remove_container
from agentenv.fastpath.errors import RestoreNotVerified
from agentenv.fastpath.host import HostSupport, probe
from agentenv.fastpath.procs import memory_bytes, process_tree, tree_matches
from agentenv.fastpath.settings import FastPathSettings
from agentenv.fastpath.store import RECORD_FILE, CheckpointRecord, CheckpointStore, _disk_bytes

log = logging.getLogger(__name__)

RESTORE_OK = "Restore finished successfully"
# CRIU could not freeze every task in time (e.g. one in uninterruptible sleep): it resumed them all.
_TRANSIENT_DUMP_ERRORS = ("Timeout reached", "Unseizable non-zombie")
_MIN_RESERVATION = 8 * 2**20


@dataclass(frozen=True)
class GcReport:
    """What `FastPath.gc()` removed (or would remove, with dry_run)."""

    orphan_containers: int
    freed_bytes: int
    unpacked_copies: int
    removed: list[str]


class FastPath:
    """Pause / resume / fork of Docker containers by container id (the sandbox layer maps its ids)."""

    def __init__(self, settings: FastPathSettings | None = None, api: docker.APIClient | None = None):
        self.settings = settings or FastPathSettings.load()
        self.host: HostSupport = probe(self.settings)
        self.api: docker.APIClient = api or docker.APIClient(
            version="auto",
            timeout=int(self.settings.op_timeout_s),
            max_pool_size=max(10, 2 * self.settings.fork_parallelism),
        )
        self.store = CheckpointStore(self.settings.store_dir, self.settings.disk_cap)
        self.docker_root = Path(self.api.info()["DockerRootDir"])
        self._task_dir = (
            Path(self.settings.containerd_address).parent
            / "daemon"
            / "io.containerd.runtime.v2.task"
            / self.settings.containerd_namespace
        )

    # ---- helpers -----------------------------------------------------------------------------
    def _inspect(self, container: str) -> dict[str, Any]:
        try:
            return self.api.inspect_container(container)
        except docker.errors.NotFound:
            raise SandboxNotFound(f"no Docker container {container!r}") from None

    def _checkpointable(self, info: dict[str, Any]) -> None:
        state, host = info["State"], info["HostConfig"]
        name = info["Name"].lstrip("/")
        if not state.get("Running") or state.get("Paused"):
            raise SandboxStateError(f"container {name} is not running (state: {state.get('Status')})")
        if info["Config"].get("Tty"):
            raise CheckpointError(f"container {name} has a TTY; CRIU cannot checkpoint it (run without -t)")
        if host.get("AutoRemove"):
            raise CheckpointError(
                f"container {name} was started with --rm; Docker would delete it at checkpoint"
            )
        policy = (host.get("RestartPolicy") or {}).get("Name") or "no"
        if policy != "no":
            raise CheckpointError(
                f"container {name} has restart policy {policy!r}; Docker would start it fresh after the "
                "checkpoint. Sandboxes must use restart policy 'no'."
            )

    def _ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [
            self.host.ctr_path,
            "--address",
            self.settings.containerd_address,
            "--namespace",
            self.settings.containerd_namespace,
            *args,
        ]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=self.settings.op_timeout_s)
        except subprocess.TimeoutExpired:
            raise CheckpointError(f"`{' '.join(cmd)}` ran past {self.settings.op_timeout_s:.0f} s") from None

    def _docker_start(self, container_id: str, checkpoint: str) -> None:
        """POST /containers/{id}/start?checkpoint=NAME (docker-py has no keyword for it)."""
        res = self.api._post(
            self.api._url("/containers/{0}/start", container_id), params={"checkpoint": checkpoint}
        )
        self.api._raise_for_status(res)

    def restore_log(self, container_id: str) -> Path:
        return self._task_dir / container_id / "work" / "restore.log"

    # ---- pause -------------------------------------------------------------------------------
    def pause(self, container: str) -> CheckpointRecord:
        """Checkpoint the container to the store and stop it (no memory, no CPU left in use).

        Raises DiskCapExceeded before touching the container when the store has no room, and
        CheckpointError (with CRIU's log excerpt) when CRIU fails; in both cases it keeps running.
        """
        info = self._inspect(container)
        self._checkpointable(info)
        cid, pid = info["Id"], int(info["State"]["Pid"])
        processes = process_tree(pid)
        need = max(_MIN_RESERVATION, int(memory_bytes(pid) * self.settings.pause_headroom))
        with self.store.reserve(cid, need) as path:
            work = self.store.work_dir(path)
            self._dump(cid, path, work)
            self.api.wait(cid, condition="not-running", timeout=int(self.settings.op_timeout_s))
            # CRIU restores a container into a new time namespace when the dump carries clock values;
            # processes that `docker exec` starts later stay in the host's, and the next restore then
            # fails ("Can't restore sub-task in NS"). Without the host-clock image the restored
            # processes stay in the host's time namespace: monotonic clocks advance across a pause.
            drop_host_clock_image(path)
            record = CheckpointRecord(
                container_id=cid,
                name=path.name,
                path=path,
                created=time.time(),
                image_bytes=_disk_bytes(path),
                processes=processes,
            )
            self.store.save(record)
            shutil.rmtree(work, ignore_errors=True)
        return record

    def _dump(self, cid: str, path: Path, work: Path) -> None:
        """`ctr tasks checkpoint --exit`; one retry when CRIU could not freeze every task in time (a
        task in uninterruptible sleep, seen on a heavily loaded host): CRIU then resumed them all."""
        for attempt in range(2):
            for leftover in path.iterdir():
                leftover.unlink()
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            r = self._ctr(
                "tasks", "checkpoint", "--exit", "--image-path", str(path), "--work-path", str(work), cid
            )
            if r.returncode == 0:
                return
            crit_log = _log_tail(work / "dump.log")
            transient = any(s in crit_log for s in _TRANSIENT_DUMP_ERRORS)
            if attempt == 0 and transient and self._inspect(cid)["State"].get("Running"):
                log.warning("checkpoint of %s failed transiently, retrying: %s", cid[:12], crit_log[-200:])
                continue
            raise CheckpointError(
                f"CRIU could not checkpoint container {cid[:12]} (it keeps running): "
                f"{r.stderr.strip()[-300:]}\n{crit_log}"
            )

    # ---- resume ------------------------------------------------------------------------------
    def resume(
        self, container: str, record: CheckpointRecord | None = None, keep_images: bool = False
    ) -> None:
        """Restore the container's latest checkpoint into it through Docker and verify the restore.

        The images are deleted afterwards unless `keep_images` (e.g. a warm-start template).
        """
        info = self._inspect(container)
        cid = info["Id"]
        if info["State"].get("Running"):
            raise SandboxStateError(f"container {info['Name'].lstrip('/')} is already running")
        record = record or self.store.latest(cid)
        if record is None:
            raise CheckpointError(f"container {cid[:12]} has no checkpoint in {self.store.root}")
        self._restore(cid, record)
        if not keep_images:
            self.store.delete(record)

    def record_at(self, path: str | Path) -> CheckpointRecord | None:
        """The store's record of the checkpoint in folder `path` (None: not a fast-path checkpoint)."""
        path = Path(path)
        if self.store.root.resolve() not in path.resolve().parents:
            return None
        try:
            return CheckpointRecord.from_json((path / RECORD_FILE).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def restore_into(self, container_id: str, record: CheckpointRecord) -> None:
        """Restore `record` into the stopped container `container_id` (its own or a fork's), verified.

        The images stay; a fork target must already hold a copy of the source's files.
        """
        self._restore(container_id, record)

    def _restore(self, container_id: str, record: CheckpointRecord) -> None:
        try:
            self._restore_once(container_id, record, self.settings.link_pages)
        except RestoreNotVerified:
            raise
        except CheckpointError as e:
            if not self.settings.link_pages:
                raise
            log.warning("restore with linked page images failed (%s); retrying with real copies", e)
            self._restore_once(container_id, record, link_pages=False)

    def _restore_once(self, container_id: str, record: CheckpointRecord, link_pages: bool) -> None:
        name = f"k3rl-r-{uuid.uuid4().hex[:12]}"
        docker_dir = self.docker_root / "containers" / container_id / "checkpoints" / name
        token = dockerlink.materialize(record.path, docker_dir, link_pages)
        started = time.time()
        try:
            self._docker_start(container_id, name)
        except docker.errors.APIError as e:
            raise CheckpointError(
                f"restoring container {container_id[:12]} from {record.path} failed: {e.explanation}"
            ) from None
        finally:
            shutil.rmtree(docker_dir, ignore_errors=True)
            dockerlink.remove_unpacked_copies(self.settings.containerd_tmp, {token})
        if self.settings.verify_restore:
            self._verify(container_id, record, started)

    def _verify(self, container_id: str, record: CheckpointRecord, started: float) -> None:
        info = self._inspect(container_id)
        pid = int(info["State"].get("Pid") or 0)
        log_file = self.restore_log(container_id)
        try:
            fresh = log_file.stat().st_mtime >= started - 1.0
            ok_log = fresh and RESTORE_OK in log_file.read_text(errors="replace")[-4096:]
        except OSError:
            ok_log = False
        if not info["State"].get("Running") or not ok_log:
            raise RestoreNotVerified(
                f"Docker started container {container_id[:12]} but CRIU's log {log_file} does not show a "
                "restore of this start: the container started fresh, its memory state is lost"
            )
        if not tree_matches(record.processes, process_tree(pid)):
            raise RestoreNotVerified(
                f"container {container_id[:12]} came back without its checkpointed init process"
            )

    # ---- fork --------------------------------------------------------------------------------
    def fork(self, container: str, n: int, labels: dict[str, str] | None = None) -> list[str]:
        """n new running containers, each restored from the container's state; returns their ids.

        A running source is checkpointed, then restored alongside its forks; a paused source (e.g. a
        warm-start template) stays paused and keeps its images.
        """
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        info = self._inspect(container)
        cid = info["Id"]
        was_running = bool(info["State"].get("Running"))
        record = self.pause(cid) if was_running else self.store.latest(cid)
        if record is None:
            raise CheckpointError(f"container {cid[:12]} is stopped and has no checkpoint to fork from")
        source = self._inspect(cid)
        clones: list[str] = []
        lock = threading.Lock()

        def make_one(_: int) -> str:
            # Clone then restore at once, so later clones overlap earlier restores.
            new_id = clone_container(self.api, source, labels=labels)
            with lock:
                clones.append(new_id)
            self._restore(new_id, record)
            return new_id

        try:
            with ThreadPoolExecutor(self.settings.fork_parallelism) as pool:
                futures = [pool.submit(make_one, i) for i in range(n)]
                if was_running:
                    futures.append(pool.submit(self._restore, cid, record))
                results = [f.result() for f in futures]
            forks = results[:n]
        except BaseException:
            for c in clones:
                remove_container(self.api, c)
            if was_running and not self._inspect(cid)["State"].get("Running"):
                self._restore(cid, record)  # give the source back its state before reporting the failure
            raise
        if was_running:
            self.store.delete(record)
        return forks

    # ---- disk hygiene ------------------------------------------------------------------------
    def discard(self, container_id: str) -> int:
        """Delete every checkpoint image of a container (call when its sandbox is removed)."""
        return self.store.delete_container(container_id)

    def disk_usage(self) -> int:
        return self.store.usage()

    def gc(self, stale_after_s: float | None = None, dry_run: bool = False) -> GcReport:
        """Remove images of containers Docker no longer has, and restore leftovers containerd kept."""
        stale_after_s = self.settings.op_timeout_s if stale_after_s is None else stale_after_s
        live = {c["Id"] for c in self.api.containers(all=True, quiet=True)}
        removed: list[str] = []
        orphans, freed = 0, 0
        for cid in self.store.container_ids():
            if cid not in live:
                removed.append(str(self.store.container_dir(cid)))
                freed += self.store.delete_container(cid) if not dry_run else 0
                orphans += 1
        copies = dockerlink.stale_unpacked_copies(self.settings.containerd_tmp, stale_after_s)
        for d in copies:
            removed.append(str(d))
            if not dry_run:
                shutil.rmtree(d, ignore_errors=True)
        return GcReport(
            orphan_containers=orphans, freed_bytes=freed, unpacked_copies=len(copies), removed=removed
        )


def _log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no CRIU log at {path})"
    errors = [ln for ln in text if "Error" in ln or "error" in ln]
    return "CRIU log " + str(path) + ":\n" + "\n".join((errors or text)[-lines:])
