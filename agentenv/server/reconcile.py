"""Keep the server's sandboxes in line with Docker when something died: the server itself (kill -9), a
sandbox's container (killed, OOM, removed), or dockerd (a restart stops every running container).

- `recover` runs once at start-up, before the first request: what a dead server left half-done is
  finished or undone (a create or fork it never answered is removed, a resume that ran on after it died
  is rolled back to the paused state, a record whose container is gone is forgotten);
- `sweep` runs in the reaper's thread every `liveness_check_interval_s`: a running sandbox whose
  container stopped is forgotten, so that listing no longer shows it;
- `settle` checks one sandbox when a request reaches it (marked broken, or its container stopped);
- `forget` removes a gone sandbox (container, volume, checkpoints, E2B row) and keeps why in the
  registry's row, which `gone_reason` reads back: every later request on it is told why, not just
  "not found".

Every change to a sandbox holds its registry lock (`agentenv.locks`), so nothing here races a pause,
resume or kill in progress: a sandbox whose lock is busy is left for the next round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from agentenv.backend import docker_client
from agentenv.backend.base import LABEL_HOME, LABEL_SANDBOX, ContainerRef, ContainerState
from agentenv.errors import SandboxBusy
from agentenv.locks import sandbox_lock
from agentenv.registry import SandboxRecord
from agentenv.sandbox import CONTAINER_REMOVED, remove_sandbox, runtime
from agentenv.server.store import E2BStore

log = logging.getLogger(__name__)
E2B_LABEL = "org.k3rl.agentenv.e2b"  # every sandbox made through the API (and its forks) carries it
GONE = "gone: "                       # prefix of the registry reason of a sandbox forgotten here
LOCK_TIMEOUT_S = 2.0                  # start-up: how long to wait for a sandbox's lock
CHECK_LOCK_S = 0.3                    # a request's check: a sandbox busy longer is someone else's to settle


@dataclass
class Recovery:
    """What `recover` did, by sandbox id."""

    unanswered: list[str] = field(default_factory=list)   # made by a dead server, never handed out
    rolled_back: list[str] = field(default_factory=list)  # a resume that outlived its server: paused again
    resumed: list[str] = field(default_factory=list)      # a resume that finished but for its record
    gone: list[str] = field(default_factory=list)         # container gone or stopped: forgotten
    busy: list[str] = field(default_factory=list)         # locked by another process: left alone

    def any(self) -> bool:
        return bool(self.unanswered or self.rolled_back or self.resumed or self.gone)


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


def settle(store: E2BStore, sandbox_id: str, probe: bool = False) -> str | None:
    """None while the sandbox is fine; else forget it and return why it is gone: it is marked broken (its
    container died under a command or a pause), or, with `probe`, the registry says running but its
    container is not (one inspect). A sandbox whose lock another request holds counts as fine: that
    request notices for itself."""
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
                why = why_dead(st)
            else:
                return None
            forget(store, rec, why)
            return why
    except SandboxBusy:
        return None


def recover(store: E2BStore) -> Recovery:
    """Start-up: settle every sandbox an earlier server of this home left (see the module docstring).
    Only one server may use a home at a time (`agentenv serve` holds `server.lock`), so nothing found
    here is in the middle of a request."""
    rt = runtime()
    out = Recovery()
    served = set(store.ids()) | {s["snapshot_id"] for s in store.snapshots()}
    for rec in rt.registry.list_sandboxes(include_closed=False):
        if rec.labels.get(E2B_LABEL) != "1":
            continue
        try:
            with sandbox_lock(rt.registry.lock_dir, rec.id, LOCK_TIMEOUT_S, "recover"):
                rec = rt.registry.get_sandbox(rec.id) or rec
                _recover_one(store, rec, rec.id in served, out)
        except SandboxBusy:
            out.busy.append(rec.id)
    for sid in store.ids():  # E2B rows whose sandbox the registry closed or lost
        rec = rt.registry.get_sandbox(sid)
        if rec is None or rec.state == "closed":
            store.delete(sid)
    return out


def _recover_one(store: E2BStore, rec: SandboxRecord, served: bool, out: Recovery) -> None:
    rt = runtime()
    ref = ContainerRef(rec.container or "", rec.volume or "")
    if rec.state == "creating" or not served:
        # a create or fork whose answer never left the dead server: nobody knows its id. Its container
        # may exist without the registry knowing it yet (Docker finished the create the server asked for)
        flt = {"label": f"{LABEL_SANDBOX}={rec.id}"}
        for c in docker_client.api().containers(all=True, filters=flt):
            rt.backend.remove(ContainerRef(c["Id"], ""))
        rt.backend.remove(ContainerRef("", rec.volume or f"agentenv-{rec.id}-ws"))
        remove_sandbox(rt, rec, reason="made by a server that died before answering")
        store.delete(rec.id)
        out.unanswered.append(rec.id)
        return
    if rec.state not in ("running", "paused"):
        return  # broken: the first request on it reports why and forgets it
    st = rt.backend.state(ref) if ref.container else None
    if rec.state == "running":
        if st is None or not st.running:
            why = why_dead(st) if st is not None else "its container is gone (a kill in progress when the " \
                "server died, or removed outside AgentENV)"
            forget(store, rec, why + " (found when the server restarted)")
            out.gone.append(rec.id)
        return
    if st is None:
        forget(store, rec, "its container is gone (a kill in progress when the server died, or removed "
                           "outside AgentENV; found when the server restarted)")
        out.gone.append(rec.id)
    elif st.running:  # paused in the registry, yet running: a resume outlived its server
        if rt.registry.latest_checkpoint(rec.id) is not None:
            docker_client.api().kill(ref.container)  # the checkpoint, still there, stays the truth
            out.rolled_back.append(rec.id)
        else:  # the restore had finished and its checkpoint was dropped: only the record was missing
            rt.registry.update_sandbox(rec.id, state="running", reason=None)
            out.resumed.append(rec.id)


def sweep(store: E2BStore) -> list[str]:
    """Forget every served running sandbox whose container is not running (one Docker call, then one
    inspect, under the sandbox's lock, per suspect); returns their ids."""
    rt = runtime()
    running = [r for r in rt.registry.list_sandboxes(include_closed=False)
               if r.state == "running" and r.container and r.labels.get(E2B_LABEL) == "1"]
    if not running:
        return []
    flt = {"label": f"{LABEL_HOME}={rt.home}", "status": "running"}
    alive = {c["Id"] for c in docker_client.api().containers(filters=flt)}
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
                forget(store, rec, why_dead(st))
                gone.append(rec.id)
        except SandboxBusy:
            continue  # a pause or a command holds it: they notice themselves, or the next round does
    return gone
