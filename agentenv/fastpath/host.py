"""What this host offers the fast path, found out rather than assumed.

`probe()` checks the things the fast path needs (root, `ctr`, Docker's containerd socket, a store on local
disk) and records the CRIU features that would speed it up further (lazy pages via userfaultfd, memory
dirty tracking for pre-dumps), so callers and the benchmark can say what was and was not available.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from agentenv.fastpath.errors import FastPathConfigError, FastPathUnavailable
from agentenv.fastpath.settings import FastPathSettings

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


@dataclass(frozen=True)
class HostSupport:
    """Facts about this host that decide which checkpoint features can be used."""

    ctr_path: str
    store_fs: str  # filesystem type of the image store (never a memory filesystem)
    lazy_pages: bool  # `criu check --feature uffd-noncoop`: restore could fault pages in lazily
    dirty_tracking: bool  # `criu check --feature mem_dirty_track`: pre-dump / incremental dumps work


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
        raise FastPathConfigError(
            f"store_dir {store_dir} is on {fstype}: checkpoint images there would stay in memory; "
            "point store_dir at local disk (conf/agentenv/fastpath.yaml)"
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
def _probe_cached(ctr: str, address: str, store_dir: str) -> HostSupport:
    if os.geteuid() != 0:
        raise FastPathUnavailable("the fast path drives containerd and CRIU directly and needs root")
    ctr_path = shutil.which(ctr)
    if ctr_path is None:
        raise FastPathUnavailable(f"containerd's CLI {ctr!r} is not on PATH (it ships with containerd)")
    if not Path(address).exists():
        raise FastPathUnavailable(
            f"Docker's containerd socket {address} does not exist "
            "(is dockerd running? set containerd_address)"
        )
    if shutil.which("criu") is None:
        raise FastPathUnavailable("criu is not on PATH")
    return HostSupport(
        ctr_path=ctr_path,
        store_fs=check_store_dir(Path(store_dir)),
        lazy_pages=_criu_feature("uffd-noncoop"),
        dirty_tracking=_criu_feature("mem_dirty_track"),
    )


def probe(settings: FastPathSettings) -> HostSupport:
    """Check the host once per settings (cached); raise FastPathUnavailable with the reason if unusable."""
    return _probe_cached(settings.ctr, settings.containerd_address, str(settings.store_dir))
