"""`FastPathBackend`: the docker-criu backend with pause / resume / fork through the fast path.

Everything but checkpoint and restore is inherited (containers, exec, volumes, probe, usage), so a
sandbox is the same Docker container either way; only the way its processes go to disk and come back
changes (see agentenv/fastpath/engine.py). The restore marker of the docker-criu backend is kept: it is
written before every dump and must be found after every restore, on top of the fast path's own check
of CRIU's restore log and process tree. Checkpoints made by Docker's path (e.g. before the backend was
switched) are still restored by Docker's path.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from agentenv.backend import docker_client
from agentenv.backend.base import Checkpoint, ContainerRef, ContainerSpec
from agentenv.backend.docker_criu import DockerCriuBackend, _docker_errors
from agentenv.errors import CheckpointError, ConfigError
from agentenv.fastpath.engine import FastPath
from agentenv.fastpath.errors import DiskCapExceeded, FastPathUnavailable
from agentenv.fastpath.host import probe
from agentenv.fastpath.settings import FastPathSettings

log = logging.getLogger(__name__)


class FastPathBackend(DockerCriuBackend):
    name = "fastpath"

    def __init__(self, home: Path, settings: FastPathSettings | None = None) -> None:
        super().__init__(home)
        self._settings = settings
        self._fastpath: FastPath | None = None

    @property
    def fastpath(self) -> FastPath:
        if self._fastpath is None:
            # share the process-wide connection pool of the docker-criu backend
            self._fastpath = FastPath(self._settings or FastPathSettings.load(), docker_client.api())
        return self._fastpath

    # ---- checkpoint ------------------------------------------------------------------------------
    @_docker_errors
    def checkpoint(self, ref: ContainerRef, checkpoint_id: str, *, user: str) -> Checkpoint:
        marker = self._write_restore_marker(ref)
        t0 = time.perf_counter()
        try:
            record = self.fastpath.pause(ref.container)
        except DiskCapExceeded:
            raise
        except CheckpointError as e:
            hint = self._uid_hint(ref, user)
            if not hint:
                raise
            raise CheckpointError(f"{e}{hint}") from None
        return Checkpoint(
            id=record.name,
            path=str(record.path),
            bytes=record.image_bytes,
            marker=marker,
            duration_s=time.perf_counter() - t0,
        )

    # ---- restore and fork ------------------------------------------------------------------------
    @_docker_errors
    def restore(self, ref: ContainerRef, checkpoint: Checkpoint, *, sandbox_id: str) -> None:
        record = self.fastpath.record_at(checkpoint.path)
        if record is None:
            return super().restore(ref, checkpoint, sandbox_id=sandbox_id)
        self.fastpath.restore_into(ref.container, record)
        self._verify_marker(ref, checkpoint, sandbox_id)

    @_docker_errors
    def fork(self, source: ContainerRef, checkpoint: Checkpoint, spec: ContainerSpec) -> ContainerRef:
        record = self.fastpath.record_at(checkpoint.path)
        if record is None:
            return super().fork(source, checkpoint, spec)
        ref = self._new_container(spec)
        try:
            self._copy_files(source, ref, copy_rootfs=not spec.config.read_only)
            self.fastpath.restore_into(ref.container, record)
            self._verify_marker(ref, checkpoint, spec.sandbox_id)
        except BaseException:
            self.remove(ref)
            raise
        return ref

    # ---- disk hygiene ----------------------------------------------------------------------------
    @_docker_errors
    def discard_checkpoint(self, ref: ContainerRef, checkpoint: Checkpoint) -> None:
        record = self.fastpath.record_at(checkpoint.path)
        if record is None:
            return super().discard_checkpoint(ref, checkpoint)
        self.fastpath.store.delete(record)

    @_docker_errors
    def remove(self, ref: ContainerRef) -> None:
        super().remove(ref)
        if ref.container:
            self.fastpath.discard(ref.container)

    @_docker_errors
    def collect_leftovers(self, dry_run: bool = False, older_than_s: float = 600.0) -> list[str]:
        """`agentenv gc`: Docker-path leftovers, plus fast-path images of containers Docker no longer
        has and containerd's unpacked copies of fast-path restores."""
        report = self.fastpath.gc(stale_after_s=older_than_s, dry_run=dry_run)
        return super().collect_leftovers(dry_run, older_than_s) + report.removed

    @_docker_errors
    def describe(self) -> dict[str, object]:
        host = self.fastpath.host
        return {
            **super().describe(),
            "checkpoint_store": str(self.fastpath.store.root),
            "checkpoint_store_bytes": self.fastpath.disk_usage(),
            "checkpoint_disk_cap": self.fastpath.settings.disk_cap,
            "criu_lazy_pages": host.lazy_pages,
            "criu_dirty_tracking": host.dirty_tracking,
        }


BACKENDS = ("fastpath", "docker-criu")


def select_backend(home: Path) -> DockerCriuBackend:
    """The backend this process uses: `$AGENTENV_BACKEND`, else `enabled` in conf/agentenv/fastpath.yaml.

    The fast path falls back to Docker's checkpoint path (with a warning) on hosts that cannot run it.
    """
    settings = FastPathSettings.load()
    choice = os.environ.get("AGENTENV_BACKEND") or ("fastpath" if settings.enabled else "docker-criu")
    if choice not in BACKENDS:
        raise ConfigError(f"AGENTENV_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if choice == "fastpath":
        try:
            probe(settings)
            return FastPathBackend(home, settings)
        except FastPathUnavailable as e:
            log.warning("AgentENV fast path unavailable (%s); using Docker's checkpoint path", e)
    return DockerCriuBackend(home)
