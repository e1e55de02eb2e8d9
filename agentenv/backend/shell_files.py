"""The host files every warm-backend container mounts read-only, kept under `runtime_dir`.

`init` (a copy of the static `catatonit`, so a host upgrade never strands a stopped sandbox), CRIU's
kernel-facts cache (saves 20-30 ms per CRIU run), the work folders of restores (left-over ones swept at
start) and CRIU's restore logs.

Design: docs/design/sandboxes.md#agentenv-backend-shell-files.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.procs import host_argvs
from agentenv.errors import BackendUnavailable

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
RESTORE_WORK = "restore-"  # a restore's work folder in `scratch`: restore-<12 hex digits>
STALE_WORK_S = 3600.0  # a work folder this old that no running process names is left over


@dataclass(frozen=True)
class ShellFiles:
    init: Path
    kdat: Path | None  # None: the cache could not be made here (CRIU recomputes it each run)
    scratch: Path
    logs: Path


def _init_binary(runtime_dir: Path) -> Path:
    src = shutil.which("catatonit")
    dst = runtime_dir / "init"
    if src is None:
        if dst.exists():
            return dst
        raise BackendUnavailable("the warm backend runs `catatonit` as every sandbox's init and it is not on "
                                 "PATH (Debian/Ubuntu package catatonit; make bootstrap installs it)")
    if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
        tmp = dst.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    return dst


def _kdat(runtime_dir: Path) -> Path | None:
    (runtime_dir / "kdat").mkdir(exist_ok=True)
    dst, stamp = runtime_dir / "kdat" / "criu.kdat", runtime_dir / "criu.kdat.boot"
    boot = BOOT_ID.read_text().strip()
    if dst.exists() and stamp.exists() and stamp.read_text().strip() == boot:
        return dst
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        "mount -t tmpfs k3rl-kdat /run && criu check >/dev/null 2>&1; cat /run/criu.kdat"],
                       capture_output=True, timeout=60)
    if r.returncode != 0 or not r.stdout:
        return dst if dst.exists() and dst.stat().st_size else None
    with open(dst, "r+b" if dst.exists() else "wb") as f:  # in place: running shells mount this inode
        f.write(r.stdout)
        f.truncate()
    os.chmod(dst, 0o644)
    stamp.write_text(boot)
    return dst


def sweep_scratch(scratch: Path, stale_after_s: float = STALE_WORK_S) -> list[Path]:
    """Delete the restores' work folders left over in `scratch` (their process was killed mid-restore,
    or exited while its page daemon still served, before the daemon's reaper deleted the folder): those
    older than `stale_after_s` (a restore ends within its `op_timeout_s`) that no running process names
    (a page daemon names its folder with `-W`). Returns the folders deleted."""
    cutoff = time.time() - stale_after_s
    old = set()
    for entry in os.scandir(scratch):
        with contextlib.suppress(OSError):
            if entry.name.startswith(RESTORE_WORK) and entry.is_dir() and entry.stat().st_mtime < cutoff:
                old.add(entry.path)
    if old:  # a running page daemon names its folder with `-W`
        wanted = {os.fsencode(path) for path in old}
        old -= {os.fsdecode(arg) for argv in host_argvs() for arg in argv if arg in wanted}
    stale = sorted(old)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [Path(p) for p in stale]


def prepare_runtime_files(runtime_dir: Path) -> ShellFiles:
    runtime_dir = Path(runtime_dir)
    runtime_dir.mkdir(parents=True, exist_ok=True)
    scratch = runtime_dir / "scratch"
    logs = runtime_dir / "logs"
    for d in (scratch, logs):
        d.mkdir(exist_ok=True)
    sweep_scratch(scratch)
    return ShellFiles(init=_init_binary(runtime_dir), kdat=_kdat(runtime_dir), scratch=scratch, logs=logs)
