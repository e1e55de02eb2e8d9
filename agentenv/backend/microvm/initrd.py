"""The sandbox microVMs' initramfs: busybox-static, the guest kernel's virtio and overlay modules (with the
modules they depend on, in load order), `guest/init.sh` as /init and the guest agent. Written as an
uncompressed newc cpio archive (no cpio tool needed; the kernel unpacks it without a decompressor), cached
under `<microvm_dir>/initrd/<content hash>.cpio`: a change to any input makes a new one.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable
from pathlib import Path

from agentenv.backend.microvm.hostfiles import HostFiles
from agentenv.errors import BackendUnavailable

GUEST = Path(__file__).resolve().parent / "guest"
# What the guest needs from the kernel's modules: the microvm machine's virtio-mmio transport, the root
# file system's disk, the agent's ports, the overlay that keeps writes in memory.
MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "overlay")
_DEPENDS = re.compile(rb"\x00depends=([^\x00]*)\x00")


def _module_paths(modules: Path) -> dict[str, Path]:
    """Module name (as the kernel names it, `_` for `-`) -> its .ko file."""
    return {p.name[:-3].replace("-", "_"): p for p in modules.rglob("*.ko")}


def _depends(ko: Path) -> list[str]:
    m = _DEPENDS.search(b"\x00" + ko.read_bytes())
    return [d.decode() for d in m.group(1).split(b",") if d] if m else []


def load_order(modules: Path, wanted: Iterable[str] = MODULES) -> list[tuple[str, Path]]:
    """`wanted` and what they depend on (from each module's `depends=`), dependencies first."""
    paths = _module_paths(modules)
    order: list[tuple[str, Path]] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if any(n == name for n, _ in order):
            return
        if name not in paths:
            raise BackendUnavailable(f"the guest kernel's modules ({modules}) lack {name}.ko (needed by "
                                     f"{' <- '.join(chain) or 'the guest'})")
        for dep in _depends(paths[name]):
            visit(dep, (name, *chain))
        order.append((name, paths[name]))

    for name in wanted:
        visit(name, ())
    return order


class Cpio:
    """A newc ("070701") cpio archive, built in memory."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.ino = 0

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        self.ino += 1
        encoded = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        self.out.write(b"070701" + b"".join(b"%08X" % v for v in fields) + encoded)
        self.out.write(b"\0" * (-(110 + len(encoded)) % 4))
        self.out.write(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, 0o100000 | mode, data)

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.out.getvalue()


def contents(files: HostFiles) -> list[tuple[str, bytes, int]]:
    """(path in the archive, bytes, mode) of every file."""
    order = load_order(files.modules)
    out = [("init", (GUEST / "init.sh").read_bytes(), 0o755),
           ("agent.py", (GUEST / "agent.py").read_bytes(), 0o644),
           ("bin/busybox", files.busybox.read_bytes(), 0o755),
           ("modules.order", "".join(f"{n}\n" for n, _ in order).encode(), 0o644)]
    out += [(f"modules/{n}.ko", p.read_bytes(), 0o644) for n, p in order]
    return out


def build(files: HostFiles, microvm_dir: Path) -> Path:
    """The initramfs for these host files (built once per content; concurrent builders agree)."""
    entries = contents(files)
    digest = hashlib.sha256()
    for name, data, mode in entries:
        digest.update(f"{name}\0{mode}\0{len(data)}\0".encode())
        digest.update(data)
    folder = microvm_dir / "initrd"
    path = folder / f"{digest.hexdigest()[:16]}.cpio"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    archive = Cpio()
    for d in ("bin", "modules"):
        archive.directory(d)
    for name, data, mode in entries:
        archive.file(name, data, mode)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(archive.finish())
    os.replace(tmp, path)
    return path
