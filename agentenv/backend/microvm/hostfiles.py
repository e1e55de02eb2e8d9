"""What the microvm backend needs on the host, found and checked: QEMU (7.2 or newer, with the microvm
machine), busybox-static (the initramfs's tools), Debian's cloud kernel unpacked by
scripts/install_microvm.sh (`vmlinux` and its modules) and `mkfs.ext4` (root file system images). A
missing piece raises BackendUnavailable naming it and the script that installs it.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from agentenv.errors import BackendUnavailable

INSTALL_HINT = "run `make bootstrap` (scripts/install_microvm.sh installs it)"
BUSYBOX = Path("/bin/busybox")
PT_INTERP = 3


@dataclass(frozen=True)
class HostFiles:
    qemu: str               # qemu-system-x86_64
    qemu_version: str       # "7.2.22"
    kernel_version: str     # "6.1.0-57-cloud-amd64"
    vmlinux: Path           # the uncompressed kernel QEMU boots through PVH
    modules: Path           # the kernel's lib/modules/<version> tree
    busybox: Path           # a static busybox
    mkfs_ext4: str


def _qemu_version(qemu: str) -> str:
    out = subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"version (\d+)\.(\d+)(?:\.(\d+))?", out)
    if not m:
        raise BackendUnavailable(f"{qemu} --version printed no version ({out.strip()[:80]!r})")
    return ".".join(g for g in m.groups() if g is not None)


def is_static_elf(path: Path) -> bool:
    """An ELF executable without a program interpreter (a static binary)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return False
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != PT_INTERP for i in range(phnum))


def newest_kernel(kernel_dir: Path) -> Path | None:
    """The kernel folder (`<version>/vmlinux` + `modules/`) with the highest version, or None."""
    found = [d for d in kernel_dir.glob("*") if (d / "vmlinux").is_file() and (d / "modules").is_dir()]

    def key(d: Path) -> list[int]:
        return [int(x) for x in re.findall(r"\d+", d.name)]

    return max(found, key=key) if found else None


@lru_cache(maxsize=4)
def find(kernel_dir: Path) -> HostFiles:
    """The host's QEMU, busybox, guest kernel and mkfs.ext4; BackendUnavailable naming what is missing."""
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise BackendUnavailable(f"QEMU (qemu-system-x86_64) is not installed; {INSTALL_HINT}")
    version = _qemu_version(qemu)
    if tuple(int(x) for x in version.split(".")[:2]) < (7, 2):
        raise BackendUnavailable(f"QEMU {version} is too old: the microvm backend needs 7.2 or newer "
                                 "(the microvm machine and x-ignore-shared migration)")
    kernel = newest_kernel(kernel_dir)
    if kernel is None:
        raise BackendUnavailable(f"no guest kernel in {kernel_dir} (expected <version>/vmlinux and "
                                 f"<version>/modules/); {INSTALL_HINT}")
    if not BUSYBOX.is_file() or not is_static_elf(BUSYBOX):
        raise BackendUnavailable(f"{BUSYBOX} is missing or not a static binary (the guest's initramfs needs "
                                 f"busybox-static); {INSTALL_HINT}")
    mkfs = shutil.which("mkfs.ext4")
    if mkfs is None:
        raise BackendUnavailable("mkfs.ext4 (e2fsprogs) is not installed; it makes the sandboxes' root file "
                                 f"system images; {INSTALL_HINT}")
    return HostFiles(qemu=qemu, qemu_version=version, kernel_version=kernel.name, vmlinux=kernel / "vmlinux",
                     modules=kernel / "modules", busybox=BUSYBOX, mkfs_ext4=mkfs)
