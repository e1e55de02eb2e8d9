"""Finish a pause whose process died between the dump and the registry update (kill -9 of the server), and
tell a resume that finished from one that did not: what recovery needs so that such a death loses nothing.

- A dump outlives the process that asked for it: containerd's `ctr`, runc and CRIU are other processes.
  `wait_for_dump` waits while one of the container still runs.
- `finish_pause`: a sandbox recorded running whose container stopped after a dump the registry never
  learned of is paused in that checkpoint. The dump counts as finished when the backend recorded it (its
  record file, written once the container stopped) or CRIU's log of it says so (then the record is written
  here); its restore marker is read from the image of the sandbox's runtime dir, which must name this
  sandbox, and the resume verifies the restore against it as every resume does.
- `checkpoint_intact`: a resume deletes its checkpoint (record file first) only after the restore was
  verified, and then records the sandbox running: a paused sandbox whose container runs and whose
  checkpoint record is gone was resumed.
- `drop_leftovers`: reservations, work dirs and unfinished images a dead pause left in the checkpoint
  store, which would count against `disk_cap` until the sandbox is removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import time
from pathlib import Path

from agentenv.backend.base import Checkpoint, ContainerRef
from agentenv.backend.runtime import drop_host_clock_image
from agentenv.backend.store import RESERVED_SUFFIX, WORK_SUFFIX, CheckpointStore, ImageRecord, disk_bytes
from agentenv.registry import SandboxRecord

log = logging.getLogger(__name__)
DUMP_OK = "Dumping finished successfully"  # the last line of CRIU's log of a dump that succeeded
STOP_WAIT_S = 10.0          # a finished dump: how long Docker may take to report its container stopped
RUNTIME_IMAGE_MAX = 2**20   # the runtime dir's tmpfs image is a few hundred bytes; /tmp's may be large
RUNTIME_FILES_MAX = 16      # ... and holds a handful of files: a tmpfs image with more is another one


def _store(rt) -> CheckpointStore | None:
    store = getattr(rt.backend, "store", None)
    return store if isinstance(store, CheckpointStore) else None


def dump_running(container: str) -> bool:
    """Does a checkpoint of `container` run on this host (a `ctr ... checkpoint` or `runc ... checkpoint`
    process with the container's id among its arguments)?"""
    want = container.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"checkpoint" in argv and want in argv:
            return True
    return False


def wait_for_dump(container: str, timeout_s: float) -> bool:
    """Wait (at most `timeout_s`) until no checkpoint of `container` runs; False if one still does."""
    deadline = time.monotonic() + timeout_s
    while dump_running(container):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _dump_traces(store: CheckpointStore, container: str) -> bool:
    """Has a dump of `container` begun and not cleaned up (a reservation or work dir in the store)? Only
    then can one still run: the processes are looked for then alone."""
    cdir = store.container_dir(container)
    return cdir.is_dir() and any(p.name.endswith((RESERVED_SUFFIX, WORK_SUFFIX)) for p in cdir.iterdir())


def _finished_dump(store: CheckpointStore, path: Path) -> bool:
    """Did CRIU's dump into `path` succeed (its log, kept in the work dir beside the images)?"""
    try:
        return DUMP_OK in (store.work_dir(path) / "dump.log").read_text(errors="replace")[-4096:]
    except OSError:
        return False


def _newest_finished(store: CheckpointStore, container: str) -> Path | None:
    """The newest image folder of `container` whose dump finished (recorded, or CRIU's log says so)."""
    cdir = store.container_dir(container)
    if not cdir.is_dir():
        return None
    done = [p for p in cdir.iterdir() if p.is_dir() and not p.name.endswith(WORK_SUFFIX)
            and (store.record_at(p) is not None or _finished_dump(store, p))]
    return max(done, key=lambda p: p.stat().st_mtime, default=None)


def _marker(images: Path, sandbox_id: str) -> str | None:
    """The restore marker in the image of the runtime dir (`/run/agentenv`: marker, sandbox-id, seed),
    when that image names `sandbox_id`."""
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


def finish_pause(rt, rec: SandboxRecord, wait_s: float) -> Checkpoint | None:
    """A sandbox recorded running (the caller holds its lock): wait (at most `wait_s`) for a dump of its
    container that still runs; when the container stopped after a finished dump that the registry does not
    know, record that checkpoint and the sandbox paused, and return the checkpoint. None: nothing to
    finish (the container runs, or stopped without a finished dump: the caller decides)."""
    store = _store(rt)
    if store is None or not rec.container:
        return None
    if _dump_traces(store, rec.container) and not wait_for_dump(rec.container, wait_s):
        log.warning("a checkpoint of sandbox %s still runs after %.0f s", rec.id, wait_s)
        return None
    ref = ContainerRef(rec.container, rec.volume or "")
    known = rt.registry.latest_checkpoint(rec.id)
    path = _newest_finished(store, rec.container)
    if path is None or (known is not None and Path(known.path) == path):
        return None
    deadline = time.monotonic() + STOP_WAIT_S
    while (st := rt.backend.state(ref)) is not None and st.running:
        if time.monotonic() >= deadline:
            log.warning("sandbox %s: a dump of it finished, yet its container runs", rec.id)
            return None
        time.sleep(0.1)
    if st is None:
        return None
    marker = _marker(path, rec.id)
    if marker is None:
        log.warning("sandbox %s: checkpoint %s holds no restore marker of it; not used", rec.id, path)
        return None
    record = store.record_at(path)
    if record is None:  # CRIU finished, its caller died before writing the record: write it as it would
        log.warning("sandbox %s: CRIU finished the dump %s after its caller died; recording it", rec.id, path)
        drop_host_clock_image(path)
        record = ImageRecord(container_id=rec.container, name=path.name, path=path,
                             created=path.stat().st_mtime, image_bytes=disk_bytes(path), processes=())
        store.save(record)
    ck = Checkpoint(id=record.name, path=str(path), bytes=record.image_bytes, marker=marker, duration_s=0.0)
    rt.registry.insert_checkpoint(rec.id, ck)
    rt.registry.update_sandbox(rec.id, state="paused", reason=None)
    return ck


def checkpoint_intact(rt, ck: Checkpoint) -> bool:
    """Are the checkpoint's images still there (its record file: a deletion removes it first)?"""
    store = _store(rt)
    return store.record_at(ck.path) is not None if store is not None else Path(ck.path).exists()


def drop_leftovers(rt, rec: SandboxRecord) -> list[str]:
    """Delete what dead pauses left in the store for the sandbox's container: reservations, work dirs,
    image folders without a record, but never the registry's checkpoint (the caller holds the sandbox's
    lock and no dump of it runs). Returns the paths removed."""
    store = _store(rt)
    if store is None or not rec.container:
        return []
    if _dump_traces(store, rec.container) and dump_running(rec.container):
        return []
    cdir = store.container_dir(rec.container)
    if not cdir.is_dir():
        return []
    known = rt.registry.latest_checkpoint(rec.id)
    removed = []
    for p in cdir.iterdir():
        if p.name.endswith(RESERVED_SUFFIX):
            p.unlink(missing_ok=True)
        elif p.is_dir() and (p.name.endswith(WORK_SUFFIX) or store.record_at(p) is None) \
                and (known is None or Path(known.path) != p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            continue
        removed.append(str(p))
    return removed
