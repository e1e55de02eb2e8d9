"""What this host offers the checkpoint runtime, found out rather than assumed.

`probe()` checks what a backend needs (root, CRIU, a store on local disk; for the fast path also `ctr`
and the socket of the containerd dockerd uses) and records the CRIU features that would speed it up
further (lazy pages via userfaultfd, memory dirty tracking for pre-dumps), so `agentenv info` and the
benchmark can say what was and was not available.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from agentenv.backend.containerd import Containerd, find_containerd
from agentenv.backend.settings import BackendSettings
from agentenv.errors import BackendUnavailable, ConfigError

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


@dataclass(frozen=True)
class HostSupport:
    """Facts about this host that decide which checkpoint features can be used."""

    store_fs: str  # filesystem type of the image store (never a memory filesystem)
    lazy_pages: bool  # `criu check --feature uffd-noncoop`: restore could fault pages in lazily
    dirty_tracking: bool  # `criu check --feature mem_dirty_track`: pre-dump / incremental dumps work
    ctr_path: str | None  # containerd's CLI (the fast path's dump), None when missing
    containerd: Containerd | None  # the containerd dockerd uses, None when its socket is missing


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (or its nearest existing parent), from mountinfo."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, fstype = "", "unknown"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        mount_point = fields[4].replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, right.split()[0]
    return fstype


def check_store_dir(store_dir: Path) -> str:
    """Refuse an image store on a memory filesystem: a paused sandbox must hold no memory."""
    fstype = filesystem_type(store_dir)
    if fstype in MEMORY_FILESYSTEMS:
        raise ConfigError(
            f"store_dir {store_dir} is on {fstype}: checkpoint images there would stay in memory; "
            "point store_dir at local disk (conf/agentenv/backend.yaml)"
        )
    return fstype


def _criu_feature(name: str) -> bool:
    criu = shutil.which("criu")
    if criu is None:
        return False
    try:
        r = subprocess.run([criu, "check", "--feature", name], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@lru_cache(maxsize=8)
def _probe_cached(backend: str, ctr: str, address: str, store_dir: str) -> HostSupport:
    if os.geteuid() != 0:
        raise BackendUnavailable(f"the {backend} backend writes Docker's data dir and drives CRIU: it "
                                 "needs root")
    if shutil.which("criu") is None:
        raise BackendUnavailable("criu is not on PATH (run make bootstrap)")
    ctr_path = shutil.which(ctr)
    ctrd: Containerd | None = find_containerd(address)
    if backend == "fastpath":
        if ctr_path is None:
            raise BackendUnavailable(f"containerd's CLI {ctr!r} is not on PATH (it ships with containerd)")
        if not Path(ctrd.address).exists():
            raise BackendUnavailable(
                f"the containerd socket {ctrd.address} (found from {ctrd.source}) does not exist; is dockerd "
                "running? set containerd_address in conf/agentenv/backend.yaml"
            )
    missing = [t for t in ("nsenter", "setsid", "unshare") if not shutil.which(t)]
    if backend == "warm" and missing:
        raise BackendUnavailable(f"the warm backend runs CRIU through {', '.join(missing)} (util-linux), "
                                 "which is not on PATH")
    if backend != "fastpath" and not Path(ctrd.address).exists():
        ctrd = None  # docker-criu needs no containerd; without it restores skip the restore-log check
    return HostSupport(
        store_fs=check_store_dir(Path(store_dir)),
        lazy_pages=_criu_feature("uffd-noncoop"),
        dirty_tracking=_criu_feature("mem_dirty_track"),
        ctr_path=ctr_path,
        containerd=ctrd,
    )


def probe(settings: BackendSettings, backend: str | None = None) -> HostSupport:
    """Can `backend` (default: the configured one) run here? Cached per settings; raises
    BackendUnavailable with the reason when it cannot."""
    return _probe_cached(backend or settings.backend, settings.ctr, settings.containerd_address,
                         str(settings.store_dir))
