"""Reconcile the registry with Docker: remove what one side has and the other lost.

Removes containers and volumes of unknown or closed sandboxes, closes sandboxes whose container, owner
process or keeping path is gone, and deletes runtime leftovers; each sandbox is reconciled under its lock,
so gc never races a pause or a fork in progress.

Design: docs/design/sandboxes.md#agentenv-gc.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from agentenv import spares
from agentenv.backend.base import ContainerRef
from agentenv.errors import SandboxBusy
from agentenv.locks import sandbox_lock
from agentenv.owner import KEEPER_LABEL, OWNER_LABEL, keeper_alive, owner_alive
from agentenv.runtime import remove_sandbox, runtime


@dataclass
class GcReport:
    removed_containers: list[str] = field(default_factory=list)
    removed_volumes: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    skipped_busy: list[str] = field(default_factory=list)
    removed_checkpoint_copies: list[str] = field(default_factory=list)
    closed_orphans: list[str] = field(default_factory=list)
    removed_spares: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def collect_garbage(dry_run: bool = False, stale_s: float = 600.0) -> GcReport:
    rt = runtime()
    report = GcReport()
    owned = rt.backend.list_owned(str(rt.home))
    live = {r.id: r for r in rt.registry.list_sandboxes(include_closed=False)}
    known_containers = {r.container for r in live.values() if r.container}
    known_volumes = {r.volume for r in live.values() if r.volume}
    now = time.time()

    for rec in live.values():
        try:
            with sandbox_lock(rt.registry.lock_dir, rec.id, timeout_s=1.0, action="gc"):
                rec = rt.registry.get_sandbox(rec.id) or rec
                ref = ContainerRef(rec.container or "", rec.volume or "")
                if rec.state == "creating":
                    if now - rec.created_at > stale_s:
                        report.closed.append(rec.id)
                        if not dry_run:
                            if ref.container or ref.volume:
                                rt.backend.remove(ref)
                            rt.registry.delete_sandbox(rec.id)
                    continue
                st = rt.backend.state(ref) if ref.container else None
                if st is None:
                    report.closed.append(rec.id)
                    if not dry_run:
                        rt.backend.remove(ref)
                        rt.registry.update_sandbox(rec.id, state="closed", reason="container gone (gc)")
                elif rec.state == "running" and not st.running:
                    report.broken.append(rec.id)
                    if not dry_run:
                        why = f"its container exited (exit code {st.exit_code}" + \
                              (", OOM-killed)" if st.oom_killed else ")")
                        rt.registry.update_sandbox(rec.id, state="broken", reason=why)
        except SandboxBusy:
            report.skipped_busy.append(rec.id)

    # a creation still under way; one closed above as stale had its creator die before its row knew the
    # container, so that container and volume go now, in the same pass
    creating_ids = {r.id for r in live.values() if r.state == "creating"} - set(report.closed)
    for container in owned["containers"]:
        if container in known_containers:
            continue
        sid = rt.backend.sandbox_of_container(container)
        if sid in creating_ids:
            continue  # its creator is still at work (or gc will close it once stale)
        report.removed_containers.append(container[:12])
        if not dry_run:
            rt.backend.remove(ContainerRef(container, ""))
    for volume in owned["volumes"]:
        if volume in known_volumes or any(volume == f"agentenv-{sid}-ws" for sid in creating_ids):
            continue
        report.removed_volumes.append(volume)
        if not dry_run:
            rt.backend.remove(ContainerRef("", volume))
    report.removed_checkpoint_copies = rt.backend.collect_leftovers(dry_run=dry_run, older_than_s=stale_s)
    report.closed_orphans = close_orphans(dry_run=dry_run)
    if not dry_run:
        report.removed_spares = spares.expire(rt)
    return report


def close_orphans(dry_run: bool = False) -> list[str]:
    """Close every live sandbox whose `OWNER_LABEL` names a process that is gone, or whose `KEEPER_LABEL`
    names a path that is gone; their ids. A sandbox busy with another holder of its lock is left for the
    next call."""
    rt = runtime()
    closed = []
    for rec in rt.registry.list_sandboxes(include_closed=False):
        owner, keeper = rec.labels.get(OWNER_LABEL), rec.labels.get(KEEPER_LABEL)
        if owner is not None and not owner_alive(owner):
            why = f"its owner process {owner.split(':')[1]} is gone (gc)"
        elif keeper is not None and not keeper_alive(keeper):
            why = f"{keeper}, which kept it, is gone (gc)"
        else:
            continue
        try:
            with sandbox_lock(rt.registry.lock_dir, rec.id, timeout_s=1.0, action="gc"):
                rec = rt.registry.get_sandbox(rec.id) or rec
                if rec.state == "closed":
                    continue
                closed.append(rec.id)
                if not dry_run:
                    remove_sandbox(rt, rec, reason=why)
        except SandboxBusy:
            continue
    return closed
