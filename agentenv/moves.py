"""Moving a paused sandbox to another `agentenv serve` host, from the host that holds it.

The destination's journal (`agentenv.imports`) is the one record of whether a move happened; until it says
`done` this host keeps everything, so a failure anywhere leaves the sandbox paused here, never lost, and
`settle` finishes a move whose answer was missed.

Design: docs/design/sandboxes.md#agentenv-moves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentenv.backend.base import Checkpoint
from agentenv.backend.store import RECORD_FILE
from agentenv.backend.transfer import FORMAT, IMAGES, ROOTFS, WORKDIR, Packer, Part, archive_tree, host_facts
from agentenv.errors import (
    AgentEnvError,
    BackendUnavailable,
    CheckpointError,
    HostUnavailable,
    InvalidArgument,
    SandboxBusy,
    SandboxStateError,
)
from agentenv.faults import crash_point
from agentenv.locks import sandbox_lock
from agentenv.registry import SandboxRecord

if TYPE_CHECKING:
    from agentenv.remote import SandboxHost
    from agentenv.runtime import Runtime

log = logging.getLogger(__name__)
MOVING = "moving"            # the registry state of a sandbox on its way to another host
MOVED = "moved to "          # the registry reason of a sandbox that left for another host (then its URL)
JOURNAL_DIR = "moves"
FINAL = ("done", "failed", "absent")  # what the destination's journal says once a move is decided
SETTLE_WAIT_S = 30.0         # a failed send: how long to wait for a destination still importing to decide
SETTLE_LOCK_S = 0.3          # sweeps: a sandbox busy for longer is left for the next round
ASK_AGAIN_S = 30.0           # sweeps: how long to leave a destination that gave no word before asking again
_quiet_until: dict[str, float] = {}  # sandbox id -> when sweeps ask its destination again


@dataclass(frozen=True)
class Moved:
    """A finished move: the destination's URL, its answer (`sandboxID`, `envdAccessToken`, ...), the
    stream's `bytes` and the seconds each step took here (`export_s`, `check_s`, `send_s`, `remove_s`) and
    there (`destination`)."""

    url: str
    answer: dict[str, Any]
    timings: dict[str, Any] = field(default_factory=dict)


# ---- journals: one small JSON file per entry, replaced atomically ------------------------------------
def write_journal(path: Path, entry: dict[str, Any]) -> None:
    """Write `entry` to `path` so that a reader sees the old or the new file whole, and it survives a
    crash of the machine (fsync of the file and of its folder)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may name the destination's key
    try:
        os.write(fd, json.dumps(entry, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_journal(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def _journal(rt: Runtime, sandbox_id: str) -> Path:
    return rt.home / JOURNAL_DIR / f"{sandbox_id}.json"


# ---- the move ----------------------------------------------------------------------------------------
class Movable(Protocol):
    """What `move` uses of the sandbox handle it moves (`agentenv.sandbox.Sandbox`, which imports this
    module: it is named here by its shape)."""

    _rt: Runtime

    @property
    def id(self) -> str: ...

    def _lock(self, action: str) -> AbstractContextManager[object]: ...

    def _record(self) -> SandboxRecord: ...

    def _restorable(self, rec: SandboxRecord, ck: Checkpoint, action: str) -> Checkpoint: ...


def move(sb: Movable, to: str, *, api_key: str | None = None, timeout_s: int | None = None) -> Moved:
    """Move the paused sandbox `sb` to the `agentenv serve` host at `to` (API key `api_key`, else
    `$AGENTENV_API_KEY`), which restores it (time to live `timeout_s`, default its own); see the module
    docstring. Errors: the destination's refusal (ImageError, BackendUnavailable, SandboxStateError, ...:
    the sandbox stays paused here), CheckpointError (the import failed: it stays paused here),
    HostUnavailable (no word from the destination: it stays `moving` until one comes)."""
    from agentenv.remote import shared_host

    host = shared_host(to, api_key)  # one connection pool (and TLS context) per destination per process
    with sb._lock("move"):
        rec = settle_locked(sb._rt, sb._record())
        if rec.state != "paused":
            raise SandboxStateError(f"sandbox {sb.id} is {rec.state}; only a paused sandbox moves" +
                                    (" (pause it first)" if rec.state == "running" else ""))
        return _move_locked(sb, rec, host, api_key, timeout_s)


def _move_locked(sb: Movable, rec: SandboxRecord, host: SandboxHost, api_key: str | None,
                 timeout_s: int | None) -> Moved:
    rt, timings = sb._rt, {}
    if rt.backend.name == "microvm":  # its snapshot is a RAM file and a device state, not CRIU images
        raise BackendUnavailable(f"sandbox {sb.id} runs on the microvm backend; a move carries CRIU "
                                 "checkpoints only (docs/agentenv.md, 'The microvm backend')")
    row = rt.registry.latest_checkpoint(sb.id)
    if row is None:
        raise CheckpointError(f"sandbox {sb.id} is paused but has no checkpoint in the registry")
    ck = sb._restorable(rec, row, "moved")
    move_id = secrets.token_hex(8)
    spool = rt.home / JOURNAL_DIR / f"{sb.id}-{move_id}"
    try:
        t = time.perf_counter()
        manifest, parts = _export(rt, rec, ck, move_id, spool)
        packer = Packer(manifest, parts)
        timings["export_s"], timings["bytes"] = time.perf_counter() - t, packer.size
        t = time.perf_counter()
        host.request("POST", "/agentenv/imports/check", json=manifest)  # a refusal raises; nothing changed
        timings["check_s"] = time.perf_counter() - t
        write_journal(_journal(rt, sb.id), {"move_id": move_id, "to": host.url, "api_key": api_key,
                                            "started": time.time()})
        rt.registry.update_sandbox(sb.id, state=MOVING, reason=f"moving to {host.url} (move {move_id})")
        crash_point("move-marked")
        t = time.perf_counter()
        try:
            answer = _send(host, packer, timeout_s)
        except Exception as e:  # noqa: BLE001 - whatever broke the send, the destination's word decides
            verdict = _verdict(host, move_id, SETTLE_WAIT_S)
            rec = _apply(rt, rt.registry.get_sandbox(sb.id) or rec, verdict, str(e))
            if rec.state != "closed":
                raise _undone(sb.id, host.url, rec, e) from None
            answer = {"sandboxID": sb.id}  # done after all; the destination's token comes with a get there
        timings["send_s"] = time.perf_counter() - t
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    crash_point("move-confirmed")
    t = time.perf_counter()
    if rt.registry.get_sandbox(sb.id).state == MOVING:
        _finish(rt, rt.registry.get_sandbox(sb.id), host.url)
    timings["remove_s"] = time.perf_counter() - t
    timings["destination"] = answer.pop("timings", {})
    return Moved(host.url, answer, timings)


def _export(rt: Runtime, rec: SandboxRecord, ck: Checkpoint, move_id: str,
            spool: Path) -> tuple[dict[str, Any], list[Part]]:
    """The manifest and the parts of the stream: the checkpoint's files as they are, the work dir (and
    with `read_only: false` the writable root) archived into `spool`."""
    from agentenv.backend.base import ContainerRef
    from agentenv.config import SandboxConfig

    record = rt.backend.store.record_at(ck.path)
    if record is None or record.format != "tree":
        raise CheckpointError(f"sandbox {rec.id}'s checkpoint {ck.id} was made by a Docker backend; only "
                              "checkpoints of the warm backend move (resume it, then pause it again here)")
    parts = []
    for path in sorted(Path(ck.path).iterdir()):
        if path.name == RECORD_FILE:
            continue
        if not path.is_file() or path.is_symlink():
            raise CheckpointError(f"checkpoint {ck.id} holds {path.name}, which is not a regular file")
        parts.append(Part(IMAGES + path.name, path))
    spool.mkdir(mode=0o700, parents=True)
    roots = rt.backend.sandbox_files(ContainerRef(rec.container or "", rec.volume or ""),
                                     rootfs=not SandboxConfig.from_dict(rec.config).read_only)
    for name, kind in ((WORKDIR, "workdir"), (ROOTFS, "rootfs")):
        if kind in roots:
            archive_tree(roots[kind], spool / name)
            parts.append(Part(name, spool / name))
    checkpoint = json.loads(record.to_json())
    for local in ("container_id", "name", "path", "created", "image_bytes"):
        checkpoint.pop(local)
    manifest = {
        "format": FORMAT, "move_id": move_id, "host": host_facts(), "checkpoint": checkpoint,
        "checkpoint_duration_s": ck.duration_s,
        "sandbox": {"id": rec.id, "image": rec.image, "user": rec.user, "config": rec.config,
                    "labels": rec.labels, "parent_id": rec.parent_id,
                    "parent_checkpoint": rec.parent_checkpoint, "cpu_seconds_before": rec.cpu_seconds_before},
        "parts": {p.name: p.size for p in parts},
    }
    return manifest, parts


def _send(host: SandboxHost, packer: Packer, timeout_s: int | None) -> dict[str, Any]:
    """POST the stream; the destination answers once the sandbox runs there."""
    def body() -> Iterator[bytes]:
        sent, half = 0, packer.size // 2
        for chunk in packer:
            yield chunk
            sent += len(chunk)
            if sent >= half:
                crash_point("move-streaming")  # a death with half the bytes out (tests)
    params = {"timeout": timeout_s} if timeout_s is not None else {}
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(packer.size)}
    return host.request("POST", "/agentenv/imports", content=body(), params=params, headers=headers,
                        on_500=CheckpointError, timeout=host.settings.lifecycle_timeout_s).json()


def _undone(sandbox_id: str, url: str, rec: SandboxRecord, error: Exception) -> AgentEnvError:
    """The error of a move that did not finish, saying where the sandbox is now: the destination's refusal
    keeps its type, a failed transfer is a CheckpointError."""
    if rec.state == MOVING:
        return HostUnavailable(f"sandbox {sandbox_id}: {url} did not say whether it took the sandbox "
                               f"({error}); it stays '{MOVING}' here until {url} answers (its next resume, "
                               "fork, close or move here asks again)")
    kind = type(error) if isinstance(error, AgentEnvError) and not isinstance(
        error, HostUnavailable | SandboxBusy | InvalidArgument) else CheckpointError
    return kind(f"sandbox {sandbox_id} did not move, it is {rec.state} here: {error}")


# ---- deciding a move ---------------------------------------------------------------------------------
def _verdict(host: SandboxHost, move_id: str, wait_s: float) -> dict[str, Any] | None:
    """The destination's word on the move (its `state`: done, failed, absent, receiving, restoring),
    waiting up to `wait_s` while it still imports; None when it does not answer."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            verdict = host.request("GET", f"/agentenv/imports/{move_id}").json()
        except AgentEnvError as e:
            log.warning("move %s: %s gave no word on it: %s", move_id, host.url, e)
            return None
        if verdict.get("state") in FINAL or time.monotonic() >= deadline:
            return verdict
        time.sleep(0.2)


def _apply(rt: Runtime, rec: SandboxRecord, verdict: dict[str, Any] | None, why: str = "") -> SandboxRecord:
    """Act on the destination's word on the move of the `moving` sandbox `rec` (the caller holds its lock);
    its row afterwards."""
    entry = read_journal(_journal(rt, rec.id)) or {}
    url = entry.get("to", "?")
    state = (verdict or {}).get("state")
    if state == "done":
        _finish(rt, rec, url)
    elif state in ("failed", "absent"):
        reason = verdict.get("reason") or why or "it never arrived"
        rt.registry.update_sandbox(rec.id, state="paused", reason=f"its move to {url} failed: {reason}")
        _journal(rt, rec.id).unlink(missing_ok=True)
        log.warning("sandbox %s stays here, paused: its move to %s failed (%s)", rec.id, url, reason)
    return rt.registry.get_sandbox(rec.id) or rec


def _finish(rt: Runtime, rec: SandboxRecord, url: str) -> None:
    """The destination restored the sandbox: remove this copy; its row stays, closed, saying where it went."""
    from agentenv.runtime import remove_sandbox

    remove_sandbox(rt, rec, reason=MOVED + url)
    _journal(rt, rec.id).unlink(missing_ok=True)


def settle_locked(rt: Runtime, rec: SandboxRecord, wait_s: float = 0.0) -> SandboxRecord:
    """`rec` once its move is decided as far as the destination can tell now (the caller holds the
    sandbox's lock): a `moving` sandbox is asked about; any other row only loses a stale journal entry."""
    journal = _journal(rt, rec.id)
    for spool in journal.parent.glob(f"{rec.id}-*"):  # a dead move's archives (the lock says none runs)
        shutil.rmtree(spool, ignore_errors=True)
    if rec.state != MOVING:
        if journal.exists():
            journal.unlink(missing_ok=True)  # a move decided (or never sent) before its entry was removed
        return rec
    entry = read_journal(journal)
    if entry is None:
        log.warning("sandbox %s is %s but its journal entry %s is gone; it stays here, paused", rec.id,
                    MOVING, journal)
        rt.registry.update_sandbox(rec.id, state="paused", reason="its move's journal entry was lost")
        return rt.registry.get_sandbox(rec.id) or rec
    from agentenv.remote import shared_host

    try:
        host = shared_host(entry["to"], entry.get("api_key"))
    except AgentEnvError as e:  # no key in this process: nobody here can ask
        log.warning("sandbox %s: cannot ask %s about its move: %s", rec.id, entry.get("to"), e)
        return rec
    return _apply(rt, rec, _verdict(host, entry["move_id"], wait_s))


def settle(sandbox_id: str, lock_timeout_s: float = SETTLE_LOCK_S) -> SandboxRecord | None:
    """Settle one sandbox's move under its lock (see `settle_locked`); None when it is busy or unknown."""
    from agentenv.runtime import runtime

    rt = runtime()
    with contextlib.suppress(SandboxBusy):
        with sandbox_lock(rt.registry.lock_dir, sandbox_id, lock_timeout_s, "settle its move"):
            rec = rt.registry.get_sandbox(sandbox_id)
            return settle_locked(rt, rec) if rec is not None else None
    return None


def settle_all() -> list[SandboxRecord]:
    """Settle every `moving` sandbox of this home that no one holds (server start-up, liveness sweeps);
    the rows of those it settled. A destination that gave no word is asked again after `ASK_AGAIN_S` (its
    attempts cost the sweep seconds), sooner by any call on the sandbox."""
    from agentenv.runtime import runtime

    out, now = [], time.monotonic()
    for rec in runtime().registry.list_sandboxes():
        if rec.state != MOVING or _quiet_until.get(rec.id, 0.0) > now:
            continue
        done = settle(rec.id)
        if done is not None and done.state != MOVING:
            _quiet_until.pop(rec.id, None)
            out.append(done)
        else:
            _quiet_until[rec.id] = time.monotonic() + ASK_AGAIN_S
    return out


def moved_to(rec: SandboxRecord | None) -> str | None:
    """The URL a closed sandbox moved to, or None."""
    if rec is None or rec.state != "closed" or not (rec.reason or "").startswith(MOVED):
        return None
    return rec.reason[len(MOVED):]
