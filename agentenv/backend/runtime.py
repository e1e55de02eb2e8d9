"""`CriuRuntime`: the one container runtime behind `SandboxBackend`: Docker containers, CRIU images in
one checkpoint store, restores through Docker's own `start --checkpoint` fed links to those images.

Restoring through Docker keeps `docker exec`, logs, stats and stop working as after any Docker restore;
forks share one set of page images, and every restore is verified by its restore marker.

Design: docs/design/sandboxes.md#agentenv-backend-runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import shutil
import time
import uuid
from pathlib import Path

import docker

from agentenv.backend import checkpoint_dir, containerd, criu_log, interrupted, netns
from agentenv.backend.base import (
    Checkpoint,
    ContainerNotRunning,
    ContainerRef,
    ContainerSpec,
    Settled,
)
from agentenv.backend.containers import DockerContainers
from agentenv.backend.docker_client import docker_errors, first_line
from agentenv.backend.dumpers import TRANSIENT_DUMP_ERRORS, ContainerdDump, DockerApiDump
from agentenv.backend.files import copy_tree
from agentenv.backend.host import HostSupport
from agentenv.backend.procs import process_tree, tree_matches
from agentenv.backend.settings import BackendSettings
from agentenv.backend.store import CheckpointStore, ImageRecord, disk_bytes
from agentenv.errors import CheckpointError, DiskCapExceeded, RestoreNotVerified

log = logging.getLogger(__name__)

_MIN_RESERVATION = 8 * 2**20
_STOP_WAIT_S = 10.0  # a finished dump: how long Docker may take to report its container stopped
_DUMP_ATTEMPTS = 3


def drop_host_clock_image(images: Path) -> None:
    """Make the restore keep the host's time namespace (see the module docstring, "Clocks")."""
    (images / "timens-0.img").unlink(missing_ok=True)


class CriuRuntime(DockerContainers):
    """Checkpoint, restore and fork of sandbox containers (see the module docstring)."""

    def __init__(self, home: Path, settings: BackendSettings, host: HostSupport, name: str,
                 reason: str) -> None:
        super().__init__(home)
        self.name = name
        self.reason = reason  # why this backend runs (for `agentenv info`)
        self.settings, self.host = settings, host
        self.dumper = (ContainerdDump if name == "fastpath" else DockerApiDump)(settings, host)
        self.store = CheckpointStore(settings.store_dir, settings.disk_cap)

    # ---- pause -------------------------------------------------------------------------------
    @docker_errors
    def checkpoint(self, ref: ContainerRef, checkpoint_id: str, *, user: str) -> Checkpoint:
        self._require_experimental()
        info = self.api.inspect_container(ref.container)
        if not info["State"].get("Running"):
            raise ContainerNotRunning(f"its container is {info['State'].get('Status')}")
        marker = self._write_restore_marker(ref)
        t0 = time.perf_counter()
        pid = int(info["State"]["Pid"])
        rss = self.usage(ref)[0]
        processes = process_tree(pid)
        need = max(_MIN_RESERVATION, int(rss * self.settings.pause_headroom))
        try:
            with self.store.reserve(info["Id"], need) as path:
                record = self._dump(info["Id"], path, processes)
        except CheckpointError as e:
            hint = "" if isinstance(e, DiskCapExceeded) else self._uid_hint(ref, user)
            if not hint:
                raise
            raise CheckpointError(f"{e}{hint}") from None
        return Checkpoint(id=record.name, path=str(record.path), bytes=record.image_bytes, marker=marker,
                          duration_s=time.perf_counter() - t0)

    def _dump(self, container: str, path: Path, processes: tuple) -> ImageRecord:
        """The backend's dump into `path`, retried (up to `_DUMP_ATTEMPTS`) when CRIU could not freeze
        every task in time and the container still runs; then the record of the images."""
        work = self.store.work_dir(path)
        try:
            for attempt in range(_DUMP_ATTEMPTS):
                for leftover in path.iterdir():
                    leftover.unlink()
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir()
                try:
                    self.dumper.dump(self.api, container, path, work)
                    break
                except CheckpointError as e:
                    transient = any(s in str(e) for s in TRANSIENT_DUMP_ERRORS)
                    if attempt + 1 == _DUMP_ATTEMPTS or not transient or not self._running(container):
                        raise
                    log.warning("checkpoint of %s failed transiently, retrying: %s", container[:12], e)
                    time.sleep(0.2 * (attempt + 1))
            self.api.wait(container, condition="not-running", timeout=int(self.settings.op_timeout_s))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        drop_host_clock_image(path)
        record = ImageRecord(container_id=container, name=path.name, path=path, created=time.time(),
                                  image_bytes=disk_bytes(path), processes=processes)
        self.store.save(record)
        return record

    def _running(self, container: str) -> bool:
        return bool(self.api.inspect_container(container)["State"].get("Running"))

    def _probe_dump(self, container: str) -> None:
        with self.store.reserve(container, _MIN_RESERVATION) as path:
            self._dump(container, path, ())
        self.store.delete_container(container)

    def _write_restore_marker(self, ref: ContainerRef) -> str:
        """A fresh random marker in the container's runtime dir, dumped with its memory: a restore that
        really restored finds it there again (see `_verify`)."""
        marker = secrets.token_hex(16)
        try:
            self._runtime_files(ref, {"marker": marker})
        except ContainerNotRunning as e:
            raise CheckpointError(f"could not write the restore marker: {e}") from None
        return marker

    def _uid_hint(self, ref: ContainerRef, user: str) -> str:
        """Why a dump of a uid-1000 sandbox failed on hosts whose CRIU cannot dump other uids ('' else)."""
        if user == "agent" and not self.probe(self.api.inspect_container(ref.container)["Image"]) \
                .can_checkpoint_other_uids:
            return ("; this host's CRIU cannot checkpoint processes of uid 1000 (see `agentenv info`): "
                    "create sandboxes with `user: auto` (root without capabilities) to pause them")
        return ""

    # ---- resume and fork ---------------------------------------------------------------------
    @docker_errors
    def restore(self, ref: ContainerRef, checkpoint: Checkpoint, *, sandbox_id: str) -> None:
        self._restore(ref, checkpoint, sandbox_id)

    @docker_errors
    def fork_files(self, source: ContainerRef, spec: ContainerSpec) -> ContainerRef:
        ref = self._new_container(spec)
        try:
            self._copy_files(source, ref, copy_rootfs=not spec.config.read_only)
        except BaseException:
            self.remove(ref)
            raise
        return ref

    @docker_errors
    def fork_into(self, source: ContainerRef, ref: ContainerRef) -> None:
        self._copy_files(source, ref, copy_rootfs=False)

    @docker_errors
    def new_container(self, spec: ContainerSpec) -> ContainerRef:
        name = spec.name or f"agentenv-{spec.sandbox_id}"
        if self._name_taken(name):  # a moved sandbox keeps its id; another home on this Docker may hold it
            name = f"{name}-{secrets.token_hex(4)}"
        return self._new_container(dataclasses.replace(spec, name=name))

    def _name_taken(self, name: str) -> bool:
        """Does Docker have a container `name` or a volume `name`-ws (which creating it would share)?"""
        for inspect, what in ((self.api.inspect_container, name), (self.api.inspect_volume, f"{name}-ws")):
            try:
                inspect(what)
                return True
            except docker.errors.NotFound:
                continue
        return False

    @docker_errors
    def sandbox_files(self, ref: ContainerRef, *, rootfs: bool) -> dict[str, Path]:
        out = {"workdir": Path(self.api.inspect_volume(ref.volume)["Mountpoint"])}
        if rootfs:
            out["rootfs"] = Path(self.api.inspect_container(ref.container)["GraphDriver"]["Data"]["UpperDir"])
        return out

    def _copy_files(self, source: ContainerRef, ref: ContainerRef, *, copy_rootfs: bool) -> None:
        """A fork's files: the work-dir volume and (unless read-only) the writable rootfs layer."""
        src, dst = self.sandbox_files(source, rootfs=copy_rootfs), self.sandbox_files(ref, rootfs=copy_rootfs)
        for kind in src:
            copy_tree(src[kind], dst[kind])

    def _restore(self, ref: ContainerRef, checkpoint: Checkpoint, sandbox_id: str) -> None:
        """Docker's `start --checkpoint` from a folder linking to `checkpoint`'s images, verified."""
        self._require_experimental()
        images = Path(checkpoint.path)
        record = self.store.record_at(images)
        name = f"agentenv-r-{uuid.uuid4().hex[:12]}"
        folder = self.docker_root() / "containers" / ref.container / "checkpoints" / name
        token = checkpoint_dir.materialize(images, folder, self.settings.link_pages)
        started = time.time()
        try:
            res = self.api._post(self.api._url("/containers/{0}/start", ref.container),
                                 params={"checkpoint": name})
            self.api._raise_for_status(res)
        except docker.errors.APIError as e:
            message = str(e.explanation or e)
            why = criu_log.explain(criu_log.log_named_in(message)) or f": {first_line(e)}"
            raise CheckpointError(f"CRIU could not restore checkpoint {checkpoint.id}{why}") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            containerd.remove_restore_copies(token=token)
        info = self.api.inspect_container(ref.container)  # the one inspect of this restore
        self._loopback_up(ref, checkpoint, info)
        self._verify(ref, checkpoint, record, sandbox_id, started, info)

    def _loopback_up(self, ref: ContainerRef, checkpoint: Checkpoint, state: dict) -> None:
        """A sandbox without a network comes back with `lo` down (see `netns.py`): bring it up."""
        if not state["Config"].get("NetworkDisabled") or not state["State"].get("Running"):
            return  # Docker's network hook did it, or the restore died (`_verify` says so)
        try:
            netns.loopback_up(int(state["State"]["Pid"]))
        except netns.NetnsError as e:
            with contextlib.suppress(docker.errors.APIError):
                self.api.kill(ref.container)
            raise CheckpointError(f"restored checkpoint {checkpoint.id}, but {e}; the checkpoint is kept at "
                                  f"{checkpoint.path}") from None

    def _verify(self, ref: ContainerRef, checkpoint: Checkpoint, record: ImageRecord | None,
                sandbox_id: str, started: float, info: dict) -> None:
        """The restore marker written before the dump must be back (else: a fresh start, or it died); with
        `verify_restore`, CRIU's log of this start must report success and the init must be back. `info`:
        the container as Docker inspected it after the start."""
        pid = int(info["State"].get("Pid") or 0)
        try:
            found = self._write_identity(ref, sandbox_id, pid=pid)
        except ContainerNotRunning as e:
            found, detail = "", str(e)
        else:
            detail = ""
        problem = ""
        if found != checkpoint.marker:
            problem = ("its restore marker is missing: it started afresh or died"
                       f"{': ' + detail if detail else ''}")
        elif self.settings.verify_restore:
            log_file = self.restore_log(info["Id"])
            if log_file is not None and not criu_log.restore_finished(log_file, started):
                problem = f"CRIU's log {log_file} shows no finished restore of this start"
            elif record is not None and not tree_matches(record.processes, process_tree(pid)):
                problem = "its checkpointed init process is not back"
        if problem:
            with contextlib.suppress(docker.errors.APIError):
                self.api.kill(ref.container)
            raise RestoreNotVerified(
                f"Docker reported a successful restore of checkpoint {checkpoint.id}, but the container did "
                f"not come back from it ({problem}); the checkpoint is kept at {checkpoint.path}")

    def restore_log(self, container_id: str) -> Path | None:
        """CRIU's restore log in the container's task bundle (None when containerd was not found)."""
        if self.host.containerd is None:
            return None
        return self.host.containerd.bundle(self.settings.containerd_namespace, container_id) / "work" / \
            "restore.log"

    # ---- after a death halfway ---------------------------------------------------------------
    @docker_errors
    def settle(self, ref: ContainerRef, sandbox_id: str, recorded: str, checkpoint: Checkpoint | None,
               wait_s: float) -> Settled:
        if recorded == "running":
            done = self._finish_pause(ref, sandbox_id, checkpoint, wait_s)
            if done is not None:
                return Settled("paused", done, note="paused")
            st = self.state(ref)
            return Settled("running") if st is not None and st.running else Settled(None, note="stopped")
        st = self.state(ref)
        if st is None:
            return Settled(None, note="gone")
        if not st.running:
            return Settled("paused")
        if checkpoint is not None and self.store.record_at(checkpoint.path) is not None:
            self.api.kill(ref.container)  # a resume outlived its caller: the intact checkpoint stays true
            return Settled("paused", note="rolled back")
        return Settled("running", drop_checkpoint=checkpoint is not None, note="resumed")

    def _finish_pause(self, ref: ContainerRef, sandbox_id: str, known: Checkpoint | None,
                      wait_s: float) -> Checkpoint | None:
        """The checkpoint a dead pause finished (its container stopped after a finished dump the registry
        does not know), recorded in the store if CRIU finished after its caller died; else None."""
        dump = interrupted.ctr_dump_of(ref.container)
        if interrupted.dump_traces(self.store, ref.container) and not interrupted.wait_for_dump(dump, wait_s):
            log.warning("a checkpoint of sandbox %s still runs after %.0f s", sandbox_id, wait_s)
            return None
        path = interrupted.newest_finished(self.store, ref.container)
        if path is None or (known is not None and Path(known.path) == path):
            return None
        deadline = time.monotonic() + _STOP_WAIT_S
        while (st := self.state(ref)) is not None and st.running:
            if time.monotonic() >= deadline:
                log.warning("sandbox %s: a dump of it finished, yet its container runs", sandbox_id)
                return None
            time.sleep(0.1)
        if st is None:
            return None
        marker = interrupted.runtime_marker(path, sandbox_id)
        if marker is None:
            log.warning("sandbox %s: checkpoint %s holds no restore marker of it; not used", sandbox_id, path)
            return None
        record = self.store.record_at(path)
        if record is None:  # CRIU finished, its caller died before writing the record: write it as it would
            log.warning("sandbox %s: CRIU finished the dump %s after its caller died; recording it",
                        sandbox_id, path)
            drop_host_clock_image(path)
            record = ImageRecord(container_id=ref.container, name=path.name, path=path,
                                 created=path.stat().st_mtime, image_bytes=disk_bytes(path), processes=())
            self.store.save(record)
        return interrupted.checkpoint_of(record, marker)

    def dump_in_progress(self, ref: ContainerRef) -> bool:
        return interrupted.dump_running(interrupted.ctr_dump_of(ref.container))

    def drop_leftovers(self, ref: ContainerRef, keep: Checkpoint | None) -> list[str]:
        return interrupted.drop_leftovers(self.store, ref.container, Path(keep.path) if keep else None,
                                          interrupted.ctr_dump_of(ref.container))

    # ---- disk hygiene ------------------------------------------------------------------------
    @docker_errors
    def discard_checkpoint(self, ref: ContainerRef, checkpoint: Checkpoint) -> None:
        path = Path(checkpoint.path)
        record = self.store.record_at(path)
        if record is not None:
            self.store.delete(record)

    @docker_errors
    def remove(self, ref: ContainerRef) -> None:
        super().remove(ref)
        if ref.container:
            self.store.delete_container(ref.container)

    @docker_errors
    def collect_leftovers(self, dry_run: bool = False, older_than_s: float = 600.0) -> list[str]:
        """`agentenv gc`: images of containers Docker no longer has, and containerd's unpacked copies."""
        live = {c["Id"] for c in self.api.containers(all=True, quiet=True)}
        removed = []
        for cid in self.store.container_ids():
            if cid not in live:
                removed.append(str(self.store.container_dir(cid)))
                if not dry_run:
                    self.store.delete_container(cid)
        return removed + containerd.remove_restore_copies(older_than_s=older_than_s, dry_run=dry_run)

    @docker_errors
    def describe(self) -> dict[str, object]:
        ctrd = self.host.containerd
        return {
            **super().describe(),
            "backend_reason": self.reason,
            "dump": "containerd checkpoint RPC" if self.name == "fastpath" else "Docker checkpoint API",
            "restore": "docker start --checkpoint, page images " + (
                "symlinked" if self.settings.link_pages else "hard-linked")
            + "; no Docker network hook for network-less sandboxes; marker and identity from the host",
            "containerd_address": ctrd.address if ctrd else None,
            "containerd_found_by": ctrd.source if ctrd else None,
            "checkpoint_store": str(self.store.root),
            "checkpoint_store_fs": self.host.store_fs,
            "checkpoint_store_bytes": self.store.usage(),
            "checkpoint_disk_cap": self.settings.disk_cap,
            "criu_lazy_pages": self.host.lazy_pages,
            "criu_dirty_tracking": self.host.dirty_tracking,
        }


