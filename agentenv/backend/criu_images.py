"""The one edit AgentENV makes to CRIU's images: give the dumped init (PID 1) another PID.

A pause dumps the whole tree from the container's init, which stays running as the warm shell, so a
restore cannot recreate PID 1: the dumped init is renumbered in `pstree.img`, restored as a copy, and killed.

Design: docs/design/sandboxes.md#agentenv-backend-criu-images.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

PSTREE = "pstree.img"
HEADER_BYTES = 8  # two magic words
PER_TASK_IMAGES = ("core", "ids", "fs", "mm", "pagemap", "sigacts", "creds")


@dataclass
class PstreeEntry:
    pid: int
    ppid: int
    pgid: int
    sid: int
    threads: list[int] = field(default_factory=list)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _encode(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _parse(message: bytes) -> PstreeEntry:
    fields: dict[int, int] = {}
    threads: list[int] = []
    i = 0
    while i < len(message):
        key, i = _varint(message, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(message, i)
            if number == 5:
                threads.append(value)
            else:
                fields[number] = value
        elif wire == 2:  # packed repeated threads
            length, i = _varint(message, i)
            end = i + length
            while i < end:
                value, i = _varint(message, i)
                threads.append(value)
        else:
            raise ValueError(f"{PSTREE}: unexpected protobuf wire type {wire}")
    return PstreeEntry(fields.get(1, 0), fields.get(2, 0), fields.get(3, 0), fields.get(4, 0), threads)


def _serialize(e: PstreeEntry) -> bytes:
    out = b"".join(_encode(number << 3) + _encode(value)
                   for number, value in ((1, e.pid), (2, e.ppid), (3, e.pgid), (4, e.sid)))
    return out + b"".join(_encode(5 << 3) + _encode(t) for t in e.threads)


def read_pstree(images: Path) -> tuple[bytes, list[PstreeEntry]]:
    """The header and entries of `images/pstree.img` (the root task first)."""
    data = (images / PSTREE).read_bytes()
    header, i, entries = data[:HEADER_BYTES], HEADER_BYTES, []
    while i < len(data):
        (length,) = struct.unpack_from("<I", data, i)
        entries.append(_parse(data[i + 4:i + 4 + length]))
        i += 4 + length
    return header, entries


def write_pstree(images: Path, header: bytes, entries: list[PstreeEntry]) -> None:
    tmp = images / (PSTREE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        for e in entries:
            body = _serialize(e)
            f.write(struct.pack("<I", len(body)) + body)
    os.replace(tmp, images / PSTREE)


def ids_in_use(entries: list[PstreeEntry]) -> set[int]:
    """Every PID the tree names: tasks, threads, and the leaders of its process groups and sessions. (A
    task that was exiting when dumped, a zombie, can carry a meaningless thread id above `pid_max`: CRIU
    restores no thread of a zombie, so such ids are left out.)"""
    limit = pid_max()
    used: set[int] = set()
    for e in entries:
        used.update((e.pid, e.pgid, e.sid, *(t for t in e.threads if t < limit)))
    return used


def pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 4194304


def renumber_root(images: Path, new_pid: int) -> int:
    """Give the tree's root task (the dumped init) PID `new_pid`; returns its old PID."""
    header, entries = read_pstree(images)
    old = entries[0].pid
    if new_pid in ids_in_use(entries):
        raise ValueError(f"PID {new_pid} is already used in {images / PSTREE}")

    def swap(v: int) -> int:
        return new_pid if v == old else v

    for e in entries:
        e.pid, e.ppid, e.pgid, e.sid = swap(e.pid), swap(e.ppid), swap(e.pgid), swap(e.sid)
        e.threads = [swap(t) for t in e.threads]
    for stem in PER_TASK_IMAGES:
        src = images / f"{stem}-{old}.img"
        if src.exists():
            os.replace(src, images / f"{stem}-{new_pid}.img")
    write_pstree(images, header, entries)
    return old
