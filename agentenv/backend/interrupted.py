"""What a state move that died halfway (kill -9 of the process that ran it) left behind, and how it ends.

Read back from the container and the checkpoint store (`Settled`): a pause whose dump finished ends
paused, one that did not ends running; a resume whose checkpoint is intact is rolled back. The runtimes'
`settle` methods apply these rules to their formats, so no sandbox is lost to a crash.

Design: docs/design/sandboxes.md#agentenv-backend-interrupted.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from agentenv.backend.base import Checkpoint
from agentenv.backend.procs import host_argvs
from agentenv.backend.store import RESERVED_SUFFIX, WORK_SUFFIX, CheckpointStore, ImageRecord

log = logging.getLogger(__name__)
DUMP_OK = "Dumping finished successfully"  # the last line of CRIU's log of a dump that succeeded
RUNTIME_IMAGE_MAX = 2**20   # the runtime dir's tmpfs image is a few hundred bytes; /tmp's may be large
RUNTIME_FILES_MAX = 16      # ... and holds a handful of files: a tmpfs image with more is another one
Argv = list[bytes]


def dump_running(match: Callable[[Argv], bool]) -> bool:
    """Does a process run on this host whose command line `match` recognises as a dump?"""
    return any(match(argv) for argv in host_argvs())


def ctr_dump_of(container: str) -> Callable[[Argv], bool]:
    """A Docker backend's dump of `container`: `ctr ... checkpoint` or `runc ... checkpoint` naming it."""
    want = container.encode()
    return lambda argv: b"checkpoint" in argv and want in argv


def wait_for_dump(match: Callable[[Argv], bool], timeout_s: float) -> bool:
    """Wait (at most `timeout_s`) until no dump `match` recognises runs; False if one still does."""
    deadline = time.monotonic() + timeout_s
    while dump_running(match):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def dump_traces(store: CheckpointStore, container: str) -> bool:
    """Has a dump of `container` begun and not cleaned up (a reservation or work dir in the store)? Only
    then can one still run: the processes are looked for then alone."""
    cdir = store.container_dir(container)
    return cdir.is_dir() and any(p.name.endswith((RESERVED_SUFFIX, WORK_SUFFIX)) for p in cdir.iterdir())


def finished_dump(store: CheckpointStore, path: Path) -> bool:
    """Did CRIU's dump into `path` succeed (its log, kept in the work dir beside the images)?"""
    try:
        return DUMP_OK in (store.work_dir(path) / "dump.log").read_text(errors="replace")[-4096:]
    except OSError:
        return False


def newest_finished(store: CheckpointStore, container: str) -> Path | None:
    """The newest image folder of `container` whose dump finished (recorded, or CRIU's log says so)."""
    cdir = store.container_dir(container)
    if not cdir.is_dir():
        return None
    done = [p for p in cdir.iterdir() if p.is_dir() and not p.name.endswith(WORK_SUFFIX)
            and (store.record_at(p) is not None or finished_dump(store, p))]
    return max(done, key=lambda p: p.stat().st_mtime, default=None)


def runtime_marker(images: Path, sandbox_id: str) -> str | None:
    """A Docker-backend dump's restore marker, in its image of the runtime dir (`/run/agentenv`: marker,
    sandbox-id, seed), when that image names `sandbox_id`."""
    for img in sorted(images.glob("tmpfs-dev-*.tar.gz.img")):
        try:
            if img.stat().st_size > RUNTIME_IMAGE_MAX:
                continue
            with tarfile.open(img, "r:gz") as tar:
                read = {}
                for i, member in enumerate(tar):
                    name = os.path.normpath(member.name)
                    if i >= RUNTIME_FILES_MAX or len(read) == 2:
                        break
                    if member.isfile() and name in ("marker", "sandbox-id"):
                        read[name] = tar.extractfile(member).read(256).decode().strip()  # type: ignore
                if len(read) < 2:
                    continue
        except (OSError, tarfile.TarError, UnicodeDecodeError):
            continue
        if read["sandbox-id"] == sandbox_id and read["marker"]:
            return read["marker"]
    return None


def checkpoint_of(record: ImageRecord, marker: str | None = None) -> Checkpoint:
    """The registry's view of a checkpoint the store recorded."""
    return Checkpoint(id=record.name, path=str(record.path), bytes=record.image_bytes,
                      marker=record.marker if marker is None else marker, duration_s=0.0)


def drop_leftovers(store: CheckpointStore, container: str, keep: Path | None,
                   dump: Callable[[Argv], bool]) -> list[str]:
    """Delete what dead pauses left in the store for `container`: reservations, work dirs, image folders
    without a record, but never `keep` (the registry's checkpoint), and nothing while a dump `dump`
    recognises runs. Returns the paths removed."""
    if dump_traces(store, container) and dump_running(dump):
        return []
    cdir = store.container_dir(container)
    if not cdir.is_dir():
        return []
    removed = []
    for p in cdir.iterdir():
        if p.name.endswith(RESERVED_SUFFIX):
            p.unlink(missing_ok=True)
        elif p.is_dir() and (p.name.endswith(WORK_SUFFIX) or store.record_at(p) is None) \
                and (keep is None or Path(keep) != p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            continue
        removed.append(str(p))
    return removed
