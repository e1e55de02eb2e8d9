"""`CheckpointStore`: every sandbox's CRIU images on local disk, with a disk-usage cap (both backends).

A pause reserves its expected size under a lock shared by all processes, so concurrent pauses cannot
together overshoot the cap; a deleted checkpoint is forgotten at once and its images freed in the
background, so a resume never waits for the unlink.

Design: docs/design/sandboxes.md#agentenv-backend-store.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from agentenv.backend.procs import ProcessInfo
from agentenv.errors import DiskCapExceeded
from agentenv.locks import file_lock

RECORD_FILE = "k3rl-checkpoint.json"
RESERVED_SUFFIX = ".reserved"
WORK_SUFFIX = ".work"


@dataclass(frozen=True)
class ImageRecord:
    """The record file kept with one CRIU image in the store: whose container, which processes, how big.
    (The registry's row of a sandbox's checkpoint is `agentenv.backend.base.Checkpoint`.)"""

    container_id: str
    name: str
    path: Path
    created: float
    image_bytes: int
    processes: tuple[ProcessInfo, ...]
    # "container": the whole container, restored by Docker (older pauses); "tree": its process tree from
    # its init, restored into a running container (`agentenv.backend.warm`), whose init was renumbered
    # to `root_pid` and whose tmpfs mounts' contents are kept as `tmpfs-<i>.tar` beside the images
    format: str = "container"
    root_pid: int = 0
    tmpfs: tuple[str, ...] = ()
    marker: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        d["path"] = str(self.path)
        d["processes"] = [[p.ns_pid, p.cmdline] for p in self.processes]
        d["tmpfs"] = list(self.tmpfs)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> ImageRecord:
        d = json.loads(text)
        d["path"] = Path(d["path"])
        d["processes"] = tuple(ProcessInfo(int(a), str(b)) for a, b in d["processes"])
        d["tmpfs"] = tuple(d.get("tmpfs", ()))
        return cls(**d)


def disk_bytes(path: Path) -> int:
    """Bytes the files under `path` occupy on disk (symlinks count nothing; a hard-linked file counts
    once per link). The one byte count of checkpoints, for the registry, the cap and the benchmark."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except FileNotFoundError:
                continue
            if not os.path.islink(os.path.join(root, f)):
                total += st.st_blocks * 512
    return total


_deleters: dict[int, ThreadPoolExecutor] = {}
_deleters_lock = threading.Lock()


def _deleter() -> ThreadPoolExecutor:
    """This process's one background deleter (a forked child makes its own: threads do not survive a
    fork); its thread is joined at interpreter exit, so pending deletions finish."""
    with _deleters_lock:
        pid = os.getpid()
        if pid not in _deleters:
            _deleters[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentenv-store-delete")
        return _deleters[pid]


def _remove_trees(*paths: Path, before: Callable[[], None] | None = None) -> None:
    if before is not None:
        before()
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class CheckpointStore:
    """CRIU images per container under one root, bounded by `cap` bytes in total."""

    def __init__(self, root: Path, cap: int) -> None:
        self.root = Path(root)
        self.cap = int(cap)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # images hold all process memory (secrets included): root only
        self._deleting: list[Future] = []
        self._deleting_lock = threading.Lock()  # forks of one sandbox drop checkpoints from threads

    # ---- paths -------------------------------------------------------------------------------
    def container_dir(self, container_id: str) -> Path:
        return self.root / container_id

    def new_checkpoint_dir(self, container_id: str) -> Path:
        """A fresh, empty folder for a new checkpoint (its name is Docker-valid: [a-zA-Z0-9_.-])."""
        name = f"k3rl-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
        path = self.container_dir(container_id) / name
        path.mkdir(parents=True)
        return path

    @staticmethod
    def work_dir(checkpoint_dir: Path) -> Path:
        return checkpoint_dir.with_name(checkpoint_dir.name + WORK_SUFFIX)

    # ---- records -----------------------------------------------------------------------------
    def save(self, record: ImageRecord) -> None:
        (record.path / RECORD_FILE).write_text(record.to_json())

    def records(self, container_id: str) -> list[ImageRecord]:
        """The container's complete checkpoints, oldest first."""
        out = []
        cdir = self.container_dir(container_id)
        if not cdir.is_dir():
            return out
        for rec_file in cdir.glob(f"*/{RECORD_FILE}"):
            try:
                out.append(ImageRecord.from_json(rec_file.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a half-written or foreign folder; gc() removes it with its container
        return sorted(out, key=lambda r: r.created)

    def latest(self, container_id: str) -> ImageRecord | None:
        recs = self.records(container_id)
        return recs[-1] if recs else None

    def record_at(self, path: str | Path) -> ImageRecord | None:
        """The record of the checkpoint in folder `path`, or None when `path` is not one of the store's."""
        path = Path(path)
        if self.root.resolve() not in path.resolve().parents:
            return None
        try:
            return ImageRecord.from_json((path / RECORD_FILE).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # ---- deletion ----------------------------------------------------------------------------
    def delete(self, record: ImageRecord, after: Callable[[], None] | None = None) -> None:
        """Forget the checkpoint now and free its images in the background (see the module docstring),
        once `after()` returned (e.g. page daemons still serving a lazy restore from them)."""
        (record.path / RECORD_FILE).unlink(missing_ok=True)
        paths = (record.path, self.work_dir(record.path))
        try:
            future = _deleter().submit(_remove_trees, *paths, before=after)
        except RuntimeError:  # the interpreter is shutting down: no new threads, delete here
            _remove_trees(*paths, before=after)
            return
        with self._deleting_lock:
            self._deleting = [f for f in self._deleting if not f.done()] + [future]

    def wait_for_deletions(self) -> None:
        """Return once every deletion this store started has freed its images."""
        with self._deleting_lock:
            pending, self._deleting = self._deleting, []
        for future in pending:
            future.result()

    def delete_container(self, container_id: str) -> int:
        """Remove every image of a container; returns the bytes freed."""
        cdir = self.container_dir(container_id)
        freed = disk_bytes(cdir) if cdir.exists() else 0
        shutil.rmtree(cdir, ignore_errors=True)
        return freed

    def container_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    # ---- disk usage and the cap --------------------------------------------------------------
    def usage(self) -> int:
        """Bytes on disk of all images, plus the reservations of pauses in progress."""
        self.wait_for_deletions()
        total = disk_bytes(self.root)
        for container_id in self.container_ids():
            try:  # a container's folder vanishes when another process removes its sandbox meanwhile
                reservations = list(self.container_dir(container_id).glob(f"*{RESERVED_SUFFIX}"))
            except FileNotFoundError:
                continue
            for res in reservations:
                try:
                    total += int(res.read_text() or 0)
                except (OSError, ValueError):
                    continue
        return total

    @contextmanager
    def reserve(self, container_id: str, need_bytes: int) -> Iterator[Path]:
        """Reserve room for a checkpoint of about `need_bytes` and yield its fresh folder.

        Raises DiskCapExceeded (before anything is written) when the store would pass its cap. On an
        exception inside the block the half-written checkpoint is removed.
        """
        with file_lock(self.root / ".cap.lock"):
            used = self.usage()
            if used + need_bytes > self.cap:
                raise DiskCapExceeded(
                    f"pausing container {container_id[:12]} needs about {need_bytes / 2**20:.0f} MiB but the "
                    f"checkpoint store {self.root} holds {used / 2**20:.0f} MiB of its "
                    f"{self.cap / 2**20:.0f} MiB cap (disk_cap in conf/agentenv/backend.yaml); the sandbox "
                    "keeps running. Close or resume paused sandboxes, run `agentenv gc`, or raise the cap."
                )
            path = self.new_checkpoint_dir(container_id)
            reservation = path.with_name(path.name + RESERVED_SUFFIX)
            reservation.write_text(str(int(need_bytes)))
        try:
            yield path
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(self.work_dir(path), ignore_errors=True)
            raise
        finally:
            reservation.unlink(missing_ok=True)
