"""Taking in a sandbox that another host moves here (`agentenv.moves` sends it; `agentenv serve` routes it).

`check` says whether this host can take it, `take` unpacks, verifies and restores it and only then writes
`done` in the move's journal (the commit), `status` answers the source, and `recover` undoes imports a dead
server left unfinished: a failure anywhere leaves the source's copy in charge.

Design: docs/design/sandboxes.md#agentenv-imports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.backend.base import LABEL_HOME, LABEL_SANDBOX, UIDS, Checkpoint, ContainerRef, ContainerSpec
from agentenv.backend.store import ImageRecord, disk_bytes
from agentenv.backend.transfer import (
    IMAGES,
    ROOTFS,
    WORKDIR,
    BadStream,
    FileSink,
    Sink,
    TreeSink,
    Unpacker,
    check_host,
    declared_parts,
)
from agentenv.config import SandboxConfig
from agentenv.errors import (
    AgentEnvError,
    BackendUnavailable,
    CheckpointError,
    DiskCapExceeded,
    ImageError,
    InvalidArgument,
    SandboxBusy,
    SandboxStateError,
)
from agentenv.faults import crash_point
from agentenv.locks import file_lock, sandbox_lock
from agentenv.moves import read_journal, write_journal
from agentenv.owner import KEEPER_LABEL, OWNER_LABEL

log = logging.getLogger(__name__)
JOURNAL_DIR = "imports"
MOVE_ID = re.compile(r"[0-9a-f]{16}")
SANDBOX_ID = re.compile(r"[0-9a-f]{6,64}")
UNFINISHED = ("receiving", "restoring")
LOCK_S = 10.0


@dataclass(frozen=True)
class Taken:
    """A sandbox moved here, running: its id, the source's manifest and the seconds each step took."""

    sandbox_id: str
    manifest: dict[str, Any]
    timings: dict[str, float]


def _runtime():
    from agentenv.runtime import runtime

    return runtime()


def _entry_path(move_id: str) -> Path:
    return _runtime().home / JOURNAL_DIR / f"{move_id}.json"


def _move_id(value: Any) -> str:
    if not isinstance(value, str) or not MOVE_ID.fullmatch(value):
        raise InvalidArgument(f"a move id is 16 hex digits, got {str(value)[:40]!r}")
    return value


# ---- can this host take it? ------------------------------------------------------------------------
def check(manifest: Any) -> dict[str, Any]:
    """The manifest's sandbox facts when this host can take the sandbox; else the error saying why not."""
    parts = declared_parts(manifest)
    _move_id(manifest.get("move_id"))
    rt = _runtime()
    if rt.backend.name != "warm":
        raise BackendUnavailable(f"this host runs the {rt.backend.name} backend; moved sandboxes restore on "
                                 "the warm backend only")
    check_host(manifest.get("host") if isinstance(manifest.get("host"), dict) else {})
    sandbox, ck = manifest.get("sandbox"), manifest.get("checkpoint")
    if not isinstance(sandbox, dict) or not isinstance(ck, dict) or ck.get("format") != "tree":
        raise BadStream("the move's manifest lacks the sandbox or its checkpoint of the warm backend")
    try:
        _record_json(manifest, "", Path("/"), 0)  # every field of the store's record, of the right types
    except (KeyError, TypeError, ValueError) as e:
        raise BadStream(f"the move's checkpoint record is incomplete: {e}") from None
    sid = sandbox.get("id")
    if not isinstance(sid, str) or not SANDBOX_ID.fullmatch(sid):
        raise InvalidArgument(f"the move's sandbox id {str(sid)[:40]!r} is not an AgentENV sandbox id")
    labels = sandbox.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(x, str) for kv in labels.items() for x in kv):
        raise BadStream("the move's sandbox labels are not a mapping of strings to strings")
    if not all(isinstance(sandbox.get(k), str | None) for k in ("image", "parent_id", "parent_checkpoint")) \
            or not isinstance(sandbox.get("image"), str):
        raise BadStream("the move's sandbox facts (image, parent) are not strings")
    if sandbox.get("user") not in UIDS:
        raise InvalidArgument(f"the move's sandbox user {sandbox.get('user')!r} is not one of {sorted(UIDS)}")
    _require_profile(SandboxConfig.from_dict(sandbox.get("config") if isinstance(sandbox.get("config"), dict)
                                             else {}))
    _require_image(str(sandbox.get("image")))
    live = rt.registry.get_sandbox(sid)
    if live is not None and live.state != "closed":
        raise SandboxStateError(f"sandbox {sid} is on this host already ({live.state})")
    need = sum(size for name, size in parts.items() if name.startswith(IMAGES))
    used = rt.backend.store.usage()
    if used + need > rt.backend.store.cap:
        raise DiskCapExceeded(f"sandbox {sid}'s checkpoint needs {need / 2**20:.0f} MiB but this host's "
                              f"checkpoint store holds {used / 2**20:.0f} MiB of its "
                              f"{rt.backend.store.cap / 2**20:.0f} MiB cap (disk_cap)")
    return sandbox


def _require_profile(cfg: SandboxConfig) -> None:
    """A moved sandbox keeps its config (limits included) but may not hold more rights than this host gives
    its own sandboxes (conf/sandbox/default.yaml here): no capability added beyond it, none of the dropped
    ones back, its network and no-new-privileges as here."""
    own = SandboxConfig.load()
    wider = []
    if not set(cfg.cap_add) <= set(own.cap_add):
        wider.append(f"cap_add {sorted(cfg.cap_add)} (here: {sorted(own.cap_add)})")
    if not ("ALL" in cfg.cap_drop or set(own.cap_drop) <= set(cfg.cap_drop)):
        wider.append(f"cap_drop {sorted(cfg.cap_drop)} (here: {sorted(own.cap_drop)})")
    if cfg.network != own.network:
        wider.append(f"network {cfg.network!r} (here: {own.network!r})")
    if own.no_new_privileges and not cfg.no_new_privileges:
        wider.append("no_new_privileges false (here: true)")
    if wider:
        raise InvalidArgument("the sandbox's config gives it more rights than this host's sandboxes have: "
                              + "; ".join(wider))


def _require_image(tag: str) -> None:
    """The sandbox's image tag must exist here: images are content-hashed, so only the same tag is the same
    root file system."""
    from agentenv.backend import images

    try:
        _runtime().backend.resolve_image(tag)
        return
    except ImageError:
        pass
    name = tag.partition(":")[0].rpartition("/")[2]
    hint = (f"build it here: `agentenv images build {name}`" if name in images.recipe_names()
            and images.tag_of(name) == tag else "load it here (`docker save` there, `docker load` here)")
    raise ImageError(f"this host has no image {tag}, which the sandbox runs; {hint}")


# ---- taking it -------------------------------------------------------------------------------------
def take(read: Callable[[int], bytes | memoryview],
         labels_for: Callable[[Mapping[str, Any]], dict[str, str]] = lambda sandbox: dict(sandbox["labels"]),
         ) -> Taken:
    """Import the stream `read` gives (see the module docstring); `labels_for(the manifest's sandbox)`: the
    labels the sandbox gets here. Returns once the sandbox runs here and the move is committed."""
    from agentenv.sandbox import Sandbox

    rt = _runtime()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    unpacker = Unpacker(read)
    manifest = unpacker.manifest()
    sandbox = check(manifest)
    move_id, sid = manifest["move_id"], sandbox["id"]
    # an owner process or a keeper path names something on the source host: meaningless here
    sandbox["labels"] = {k: v for k, v in (sandbox.get("labels") or {}).items()
                         if k not in (OWNER_LABEL, KEEPER_LABEL)}
    cfg = SandboxConfig.from_dict(sandbox["config"])
    entry = {"move_id": move_id, "sandbox_id": sid, "state": "receiving", "started": time.time()}
    _mkdir(rt.home / JOURNAL_DIR)
    with file_lock(rt.home / JOURNAL_DIR / ".lock"):
        seen = read_journal(_entry_path(move_id))
        if seen is not None:
            raise SandboxStateError(f"move {move_id} was seen here already ({seen.get('state')}); the source "
                                    "keeps the sandbox")
        old = rt.registry.get_sandbox(sid)
        if old is not None and old.state != "closed":
            raise SandboxStateError(f"sandbox {sid} is on this host already ({old.state})")
        if old is not None:
            rt.registry.delete_sandbox(sid)  # it was here before (and moved away): the new row replaces it
        write_journal(_entry_path(move_id), entry)
        rt.registry.insert_sandbox(id=sid, state="creating", image=sandbox["image"], user=sandbox["user"],
                                   config=sandbox["config"], labels=labels_for(sandbox),
                                   parent_id=sandbox.get("parent_id"),
                                   parent_checkpoint=sandbox.get("parent_checkpoint"))
    ref: ContainerRef | None = None
    try:
        with sandbox_lock(rt.registry.lock_dir, sid, LOCK_S, "take in"):
            labels = {**rt.registry.get_sandbox(sid).labels, LABEL_HOME: str(rt.home)}
            ref = rt.backend.new_container(ContainerSpec(sid, sandbox["image"], sandbox["user"], cfg, labels))
            rt.registry.update_sandbox(sid, container=ref.container, volume=ref.volume)
            write_journal(_entry_path(move_id), {**entry, "container": ref.container, "volume": ref.volume})
            roots = rt.backend.sandbox_files(ref, rootfs=not cfg.read_only)
            need = sum(s for n, s in declared_parts(manifest).items() if n.startswith(IMAGES))
            timings["prepare_s"] = time.perf_counter() - t0
            half = sum(declared_parts(manifest).values()) // 2

            def open_part(name: str) -> Sink:
                if unpacker.received >= half:
                    crash_point("import-streaming")  # a death with half the bytes in (tests)
                return _sink(name, path, roots)

            with rt.backend.store.reserve(ref.container, need) as path:
                unpacker.unpack(open_part)
                crash_point("import-received")
                record = ImageRecord.from_json(_record_json(manifest, ref.container, path, disk_bytes(path)))
                rt.backend.store.save(record)
            timings["receive_s"] = time.perf_counter() - t0 - timings["prepare_s"]
            dumped_s = float(manifest.get("checkpoint_duration_s") or 0)
            rt.registry.insert_checkpoint(sid, Checkpoint(id=path.name, path=str(path), marker=record.marker,
                                                          bytes=record.image_bytes, duration_s=dumped_s))
            rt.registry.update_sandbox(sid, state="paused",
                                       cpu_seconds_before=float(sandbox.get("cpu_seconds_before") or 0))
            write_journal(_entry_path(move_id), {**entry, "state": "restoring", "container": ref.container})
            t = time.perf_counter()
            sb = Sandbox.get(sid)
            sb._resume_locked(sb._record())
            timings["restore_s"] = time.perf_counter() - t
            crash_point("import-restored")
            write_journal(_entry_path(move_id), {**entry, "state": "done", "container": ref.container,
                                                 "finished": time.time()})
            crash_point("import-committed")
    except BaseException as e:
        _drop(sid, ref)
        write_journal(_entry_path(move_id), {**entry, "state": "failed", "reason": _reason(e)})
        raise
    timings["total_s"] = time.perf_counter() - t0
    return Taken(sid, manifest, timings)


def _mkdir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _sink(name: str, images: Path, roots: Mapping[str, Path]) -> Sink:
    if name.startswith(IMAGES):
        return FileSink(images / name[len(IMAGES):])
    if name == WORKDIR:
        return TreeSink(roots["workdir"])
    if name == ROOTFS and "rootfs" in roots:
        return TreeSink(roots["rootfs"])
    raise CheckpointError(f"the move brings {name}, but the sandbox's config has a read-only root")


def _record_json(manifest: dict[str, Any], container: str, path: Path, image_bytes: int) -> str:
    """The store's record of the checkpoint as it lies here (the source's facts, this host's place)."""
    text = json.dumps({**manifest["checkpoint"], "container_id": container, "name": path.name,
                       "path": str(path), "created": time.time(), "image_bytes": image_bytes})
    ImageRecord.from_json(text)  # KeyError, TypeError or ValueError when the source's facts are not whole
    return text


def _reason(e: BaseException) -> str:
    if isinstance(e, AgentEnvError):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _drop(sandbox_id: str, ref: ContainerRef | None) -> None:
    """Remove everything an unfinished import made: its container and work dir (found by their labels too),
    its images, its registry row."""
    rt = _runtime()
    refs = [ref] if ref is not None else []
    with contextlib.suppress(Exception):
        found = rt.backend.find({LABEL_SANDBOX: sandbox_id, LABEL_HOME: str(rt.home)})
        refs += [ContainerRef(c, "") for c in found["containers"]]
        refs += [ContainerRef("", v) for v in found["volumes"]]
    for r in refs:
        try:
            rt.backend.remove(r)
        except Exception as e:  # logged: `agentenv gc` finds what is labelled with this home
            log.warning("import of sandbox %s: could not remove %s: %s", sandbox_id, r, e)
    rt.registry.delete_sandbox(sandbox_id)


# ---- what happened to a move -----------------------------------------------------------------------
def status(move_id: str) -> dict[str, Any]:
    """The journal's entry for the move (its `state`), recording `absent` for a move never seen."""
    move_id = _move_id(move_id)
    rt = _runtime()
    _mkdir(rt.home / JOURNAL_DIR)
    with file_lock(rt.home / JOURNAL_DIR / ".lock"):
        entry = read_journal(_entry_path(move_id))
        if entry is None:
            entry = {"move_id": move_id, "state": "absent", "reason": "this host never received it",
                     "started": time.time()}
            write_journal(_entry_path(move_id), entry)
    return {k: entry.get(k) for k in ("move_id", "sandbox_id", "state", "reason")}


def recover() -> list[str]:
    """Start-up: remove what imports a dead server left unfinished (see `_drop`) and record them failed;
    the ids of their sandboxes."""
    rt = _runtime()
    dropped = []
    for path in sorted((rt.home / JOURNAL_DIR).glob("*.json")):
        entry = read_journal(path)
        if entry is None or entry.get("state") not in UNFINISHED:
            continue
        sid = str(entry.get("sandbox_id"))
        try:
            with sandbox_lock(rt.registry.lock_dir, sid, LOCK_S, "drop an unfinished import"):
                ref = ContainerRef(entry.get("container") or "", entry.get("volume") or "")
                _drop(sid, ref if ref.container or ref.volume else None)
        except SandboxBusy:
            continue
        why = f"this host's server stopped while it was {entry['state']} the sandbox"
        write_journal(path, {**entry, "state": "failed", "reason": why})
        dropped.append(sid)
        log.warning("sandbox %s: an unfinished import (move %s) was removed", sid, entry.get("move_id"))
    return dropped
