"""Keep the server's sandboxes in line with Docker when something died: the server itself (kill -9), a
sandbox's container (killed, OOM, removed), or dockerd (a restart stops every running container).

`recover` at start-up, `sweep` periodically and `settle` per request; `forget` keeps why a sandbox went.
Only what the server provably made is removed, and every change holds the sandbox's registry lock.

Design: docs/design/sandboxes.md#agentenv-server-reconcile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from agentenv import imports, moves
from agentenv.backend.base import LABEL_HOME, LABEL_SANDBOX, ContainerRef, ContainerState, Settled
from agentenv.errors import SandboxBusy
from agentenv.locks import sandbox_lock
from agentenv.registry import SandboxRecord
from agentenv.runtime import remove_sandbox, runtime
from agentenv.sandbox import CONTAINER_REMOVED
from agentenv.server.store import E2BStore

log = logging.getLogger(__name__)
GONE = "gone: "                       # prefix of the registry reason of a sandbox forgotten here
LOCK_TIMEOUT_S = 2.0                  # start-up: how long to wait for a sandbox's lock
CHECK_LOCK_S = 0.3                    # a request's check: a sandbox busy longer is someone else's to settle
DUMP_WAIT_S = 120.0                   # start-up: how long a dump a dead server started may still run
STOPPED_DUMP_WAIT_S = 10.0            # a stopped container: how long its dump's processes may take to end


@dataclass
class Recovery:
    """What `recover` did, by sandbox id."""

    unanswered: list[str] = field(default_factory=list)   # half made by a dead server: removed
    paused: list[str] = field(default_factory=list)       # a pause whose dump finished: recorded
    rolled_back: list[str] = field(default_factory=list)  # a resume that outlived its server: paused again
    resumed: list[str] = field(default_factory=list)      # a resume that finished but for its record
    gone: list[str] = field(default_factory=list)         # container gone or stopped: forgotten
    rebuilt: list[str] = field(default_factory=list)      # E2B row made again from the labels
    busy: list[str] = field(default_factory=list)         # locked by another process: left alone
    imports_dropped: list[str] = field(default_factory=list)  # unfinished imports from other hosts: removed
    moves_settled: list[str] = field(default_factory=list)    # moves left undecided: moved, or paused here

    def any(self) -> bool:
        return bool(self.unanswered or self.paused or self.rolled_back or self.resumed or self.gone
                    or self.rebuilt or self.imports_dropped or self.moves_settled)


def why_dead(st: ContainerState | None) -> str:
    """The reason recorded for a sandbox whose container is not running."""
    if st is None:
        return CONTAINER_REMOVED
    why = f"its container stopped (exit code {st.exit_code})"
    if st.oom_killed:
        why += ", killed by the kernel's OOM killer"
    return why + " outside the server (killed, out of memory, or dockerd restarted)"


def forget(store: E2BStore, rec: SandboxRecord, reason: str) -> None:
    """Remove a gone sandbox and its E2B row, recording `reason` (caller holds the sandbox's lock)."""
    remove_sandbox(runtime(), rec, reason=GONE + reason)
    store.delete(rec.id)
    log.warning("sandbox %s is gone: %s", rec.id, reason)


def gone_reason(sandbox_id: str) -> str | None:
    """Why a sandbox this server forgot is gone, or None (never served, or killed by a client)."""
    rec = runtime().registry.get_sandbox(sandbox_id) if sandbox_id else None
    if rec is None or not (rec.reason or "").startswith(GONE):
        return None
    return rec.reason[len(GONE):]


def _apply(rec: SandboxRecord, verdict: Settled) -> None:
    """Record in the registry how the sandbox's runtime says its interrupted state move ended (the caller
    holds its lock)."""
    reg = runtime().registry
    if verdict.checkpoint is not None:
        reg.insert_checkpoint(rec.id, verdict.checkpoint)
    if verdict.drop_checkpoint:
        while (ck := reg.latest_checkpoint(rec.id)) is not None:
            reg.delete_checkpoint(ck.id)
    if verdict.state is not None and verdict.state != rec.state:
        reg.update_sandbox(rec.id, state=verdict.state, reason=None)


def stopped(store: E2BStore, rec: SandboxRecord, why: str) -> str | None:
    """A sandbox recorded running whose container is not running (the caller holds its lock): paused, when
    a pause that died left its finished dump (None); else forgotten, and `why` returned."""
    rt = runtime()
    ref = ContainerRef(rec.container or "", rec.volume or "")
    verdict = rt.backend.settle(ref, rec.id, "running", rt.registry.latest_checkpoint(rec.id),
                                STOPPED_DUMP_WAIT_S)
    if verdict.state == "paused":
        _apply(rec, verdict)
        log.warning("sandbox %s: a pause that died after its dump is recorded: the sandbox is paused", rec.id)
        return None
    forget(store, rec, why)
    return why


def settle(store: E2BStore, sandbox_id: str, probe: bool = False) -> str | None:
    """None while the sandbox is fine; else forget it and return why it is gone: it is marked broken (its
    container died under a command or a pause), or, with `probe`, the registry says running but its
    container is not (one inspect; a dead pause's finished dump makes it paused instead). A sandbox whose
    lock another request holds counts as fine: that request notices for itself."""
    rt = runtime()
    try:
        with sandbox_lock(rt.registry.lock_dir, sandbox_id, CHECK_LOCK_S, "check a sandbox"):
            rec = rt.registry.get_sandbox(sandbox_id)
            if rec is None:
                return None
            if rec.state == "broken":
                why = rec.reason or "it broke"
            elif probe and rec.state == "running":
                st = rt.backend.state(ContainerRef(rec.container or "", rec.volume or ""))
                if st is not None and st.running:
                    return None
                return stopped(store, rec, why_dead(st))
            else:
                return None
            forget(store, rec, why)
            return why
    except SandboxBusy:
        return None


def recover(store: E2BStore, ttl_s: float) -> Recovery:
    """Start-up: settle every sandbox an earlier server of this home left (see the module docstring);
    `ttl_s`: the time to live of a running sandbox whose row is rebuilt. Only one server may use a home
    at a time (`agentenv serve` holds `server.lock`), so nothing found here is in the middle of a request."""
    rt = runtime()
    out = Recovery()
    for sid in imports.recover():
        store.delete(sid)
        out.imports_dropped.append(sid)
    out.moves_settled = _settle_moves(store)
    rows = set(store.ids()) | {s["snapshot_id"] for s in store.snapshots()}
    for rec in rt.registry.list_sandboxes(include_closed=False):
        if not (store.owns(rec) or rec.id in rows):
            continue  # not provably this server's (e.g. `agentenv fork` of a served sandbox): not touched
        try:
            with sandbox_lock(rt.registry.lock_dir, rec.id, LOCK_TIMEOUT_S, "recover"):
                rec = rt.registry.get_sandbox(rec.id) or rec
                _recover_one(store, _owned(store, rec), rec.id in rows, ttl_s, out)
        except SandboxBusy:
            out.busy.append(rec.id)
    for sid in store.ids():  # E2B rows whose sandbox the registry closed or lost
        rec = rt.registry.get_sandbox(sid)
        if rec is None or rec.state == "closed":
            store.delete(sid)
    return out


def _owned(store: E2BStore, rec: SandboxRecord) -> SandboxRecord:
    """`rec`, labelled as this server's when its row here says so but its labels do not (made before
    labels named the server); the registry's labels are what later recoveries read."""
    labels = None if store.owns(rec) else store.labels_of_row(rec.id)
    if labels is None:
        return rec
    runtime().registry.update_sandbox(rec.id, labels={**rec.labels, **labels})
    return runtime().registry.get_sandbox(rec.id) or rec


def _recover_one(store: E2BStore, rec: SandboxRecord, has_row: bool, ttl_s: float, out: Recovery) -> None:
    rt = runtime()
    if rec.state == "creating":
        # a create or fork that never finished: its container may exist without the registry knowing it
        # yet (Docker finished the create the server asked for). A finished one without a row (a lost
        # store, or an answer that never left) is kept: its row is rebuilt below.
        labels = {LABEL_SANDBOX: rec.id, LABEL_HOME: str(rt.home)}  # a moved sandbox keeps its id: on a
        # Docker engine that two homes share, the other home's container of it is not this one
        for container in rt.backend.find(labels)["containers"]:
            rt.backend.remove(ContainerRef(container, ""))
        rt.backend.remove(ContainerRef("", rec.volume or f"agentenv-{rec.id}-ws"))
        remove_sandbox(rt, rec, reason="made by a server that died before answering")
        store.delete(rec.id)
        out.unanswered.append(rec.id)
        return
    if rec.state not in ("running", "paused"):
        return  # broken: the first request on it reports why and forgets it
    if not _settle_container(store, rec, out):
        return
    rt.backend.drop_leftovers(ContainerRef(rec.container or "", rec.volume or ""),
                              rt.registry.latest_checkpoint(rec.id))
    if not has_row and store.row_from_labels(rec, ttl_s) is not None:
        out.rebuilt.append(rec.id)


def _settle_container(store: E2BStore, rec: SandboxRecord, out: Recovery) -> bool:
    """Bring a running or paused sandbox in line with its container and images (what its runtime says an
    interrupted pause or resume came to); False when it is forgotten."""
    rt = runtime()
    ref = ContainerRef(rec.container or "", rec.volume or "")
    if not ref.container:
        verdict = Settled(None, note="gone")
    else:
        verdict = rt.backend.settle(ref, rec.id, rec.state, rt.registry.latest_checkpoint(rec.id),
                                    DUMP_WAIT_S)
    if verdict.state is None:
        st = rt.backend.state(ref) if ref.container else None
        why = why_dead(st) if st is not None else ("its container is gone (a kill in progress when the "
                                                   "server died, or removed outside AgentENV)")
        forget(store, rec, why + " (found when the server restarted)")
        out.gone.append(rec.id)
        return False
    _apply(rec, verdict)
    done = {"paused": out.paused, "rolled back": out.rolled_back, "resumed": out.resumed}
    done.get(verdict.note, []).append(rec.id)
    if verdict.state == "running":
        while (ck := rt.registry.latest_checkpoint(rec.id)) is not None:  # a fork's, kept for its copies
            rt.backend.discard_checkpoint(ref, ck)
            rt.registry.delete_checkpoint(ck.id)
    return True


def _settle_moves(store: E2BStore) -> list[str]:
    """Settle the moves of this home's `moving` sandboxes that no one holds; a sandbox that left loses its
    E2B row here. The ids settled."""
    done = moves.settle_all()
    for rec in done:
        if rec.state == "closed":
            store.delete(rec.id)
    return [rec.id for rec in done]


def sweep(store: E2BStore) -> list[str]:
    """Forget every served running sandbox whose container is not running (one lookup of the running
    containers, then one inspect, under the sandbox's lock, per suspect); returns their ids."""
    rt = runtime()
    _settle_moves(store)
    running = [r for r in rt.registry.list_sandboxes(include_closed=False)
               if r.state == "running" and r.container and store.owns(r)]
    if not running:
        return []
    alive = set(rt.backend.find({LABEL_HOME: str(rt.home)}, running_only=True)["containers"])
    gone = []
    for rec in running:
        if rec.container in alive:
            continue
        try:
            with sandbox_lock(rt.registry.lock_dir, rec.id, CHECK_LOCK_S, "liveness check"):
                rec = rt.registry.get_sandbox(rec.id) or rec
                if rec.state != "running":
                    continue
                st = rt.backend.state(ContainerRef(rec.container or "", rec.volume or ""))
                if st is not None and st.running:
                    continue
                if stopped(store, rec, why_dead(st)) is not None:
                    gone.append(rec.id)
        except SandboxBusy:
            continue  # a pause or a command holds it: they notice themselves, or the next round does
    return gone
