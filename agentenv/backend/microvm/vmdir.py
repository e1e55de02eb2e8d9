"""Where a sandbox VM lives on the host: one folder `<microvm_dir>/vms/<name>/` (the `container` of its
`ContainerRef`) holding its record, its RAM file, its snapshots, QEMU's sockets and logs.

`meta.json` says which registry owns the VM and how its RAM is mapped; a snapshot is whole once its
`record.json` exists.

Design: docs/design/sandboxes.md#agentenv-backend-microvm-vmdir.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.backend.microvm.qemu import Machine

META = "meta.json"
RAM = "ram"
BASE_RAM = "base.ram"
RECORD = "record.json"
STATE = "state"
RESUMED = "resumed"
PAUSING = "pausing"
FROZEN = "frozen"
SHARED, STREAM = "shared", "stream"   # snapshot formats: RAM left in the VM's file, or in the stream


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (a reader sees the old or the new file), durable before it returns."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Snapshot:
    """A snapshot's record (`ck-<id>/record.json`)."""

    path: Path          # the ck-<id> folder
    format: str         # SHARED or STREAM
    marker: str         # what the restored guest's agent must report (proves it came from this snapshot)
    machine: Machine
    ram: Path | None    # SHARED: the RAM file holding its memory
    created: float

    @classmethod
    def load(cls, path: Path) -> Snapshot | None:
        d = read_json(path / RECORD)
        if d is None:
            return None
        return cls(path=path, format=d["format"], marker=d["marker"], machine=Machine.from_dict(d["machine"]),
                   ram=Path(d["ram"]) if d.get("ram") else None, created=d["created"])

    def save(self) -> None:
        write_json(self.path / RECORD, {"format": self.format, "marker": self.marker,
                                        "machine": self.machine.to_dict(),
                                        "ram": str(self.ram) if self.ram else None, "created": self.created})

    @property
    def state_file(self) -> Path:
        return self.path / STATE

    def disk_bytes(self) -> int:
        total = 0
        for p in (self.state_file, self.ram):
            if p is not None:
                with contextlib.suppress(OSError):
                    total += os.stat(p).st_blocks * 512
        return total


class VmDir:
    """One VM's folder (see the module docstring)."""

    def __init__(self, root: Path, name: str) -> None:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"not a VM name: {name!r}")
        self.name = name
        self.path = root / name

    def exists(self) -> bool:
        return (self.path / META).exists()

    @property
    def meta(self) -> dict[str, Any]:
        return read_json(self.path / META) or {}

    def update_meta(self, **changes: Any) -> None:
        write_json(self.path / META, {**self.meta, **changes})

    @property
    def machine(self) -> Machine:
        return Machine.from_dict(self.meta["machine"])

    @property
    def ram(self) -> Path:
        return self.path / RAM

    @property
    def base_ram(self) -> Path:
        return self.path / BASE_RAM

    def snapshot_dir(self, checkpoint_id: str) -> Path:
        return self.path / checkpoint_id

    def snapshot_dirs(self) -> list[Path]:
        return sorted((p for p in self.path.glob("ck-*") if p.is_dir()), key=lambda p: p.stat().st_mtime)

    @staticmethod
    def create(root: Path, name: str, meta: dict[str, Any]) -> VmDir:
        vm = VmDir(root, name)
        vm.path.mkdir(parents=True, mode=0o700)
        write_json(vm.path / META, {**meta, "created": time.time()})
        return vm
