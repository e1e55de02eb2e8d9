"""Spare shells: sandboxes made ahead of demand, created and started with nothing restored into them, so
that a fork of the same template skips Docker's create and start (about 0.2 s each, most of a cold
fork). A spare is a registry row in state `spare` whose container runs its init; a fork claims spares of
its template (image, user and config) under one host-wide lock, copies the source's files into them and
restores the checkpoint there. After a fork of n the process that forked makes n spares again in the
background, for the next fork of the group; spares nobody claimed within `spare_ttl_s` are removed
(`expire`, run at each claim and by `agentenv gc`), and a closed pool removes its templates' (`discard`).
`spare_shells: false` in conf/agentenv/backend.yaml turns them off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

from agentenv.backend.base import LABEL_HOME, ContainerRef, ContainerSpec
from agentenv.config import SandboxConfig
from agentenv.locks import file_lock
from agentenv.registry import SandboxRecord

log = logging.getLogger(__name__)
SPARE = "spare"                         # the registry state of a spare shell
TEMPLATE_LABEL = "org.k3rl.agentenv.spare-template"
_making: dict[str, int] = {}            # template -> spares this process is making now
_making_lock = threading.Lock()


def template_key(image: str, user: str, config: Mapping[str, Any]) -> str:
    """What a fork's shell must match: the image tag, the user and the whole config."""
    blob = json.dumps({"image": image, "user": user, "config": dict(config)}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _enabled(rt) -> bool:
    """Spares are made for backends that restore into a started container (the Docker backends restore
    through Docker's start, which needs a stopped one), when `spare_shells` is on."""
    backend = rt.backend
    return bool(backend.restores_into_running and getattr(backend.settings, "spare_shells", False))


def claim(rt, image: str, user: str, config: Mapping[str, Any], n: int) -> list[SandboxRecord]:
    """Up to `n` running spares of the template, now in state `creating` (the caller makes them forks)."""
    if not _enabled(rt) or n <= 0:
        return []
    key = template_key(image, user, config)
    expire(rt)
    got: list[SandboxRecord] = []
    with file_lock(rt.registry.lock_dir / "spares.lock"):
        for rec in rt.registry.list_sandboxes():
            if len(got) == n:
                break
            if rec.state != SPARE or rec.labels.get(TEMPLATE_LABEL) != key or not rec.container:
                continue
            st = rt.backend.state(ContainerRef(rec.container, rec.volume or ""))
            if st is None or not st.running:
                continue
            rt.registry.update_sandbox(rec.id, state="creating")
            got.append(rec)
    return got


def replenish(rt, image: str, user: str, config: Mapping[str, Any], n: int) -> None:
    """Make spares of the template in a background thread until `n` are ready or being made."""
    if not _enabled(rt) or n <= 0:
        return
    key = template_key(image, user, config)
    ready = sum(1 for r in rt.registry.list_sandboxes()
                if r.state == SPARE and r.labels.get(TEMPLATE_LABEL) == key)
    with _making_lock:
        missing = n - ready - _making.get(key, 0)
        if missing <= 0:
            return
        _making[key] = _making.get(key, 0) + missing
    threading.Thread(target=_make, args=(rt, image, user, dict(config), key, missing),
                     name="agentenv-spares", daemon=True).start()


def _make(rt, image: str, user: str, config: dict[str, Any], key: str, count: int) -> None:
    cfg = SandboxConfig.from_dict(config)
    try:
        for _ in range(count):
            sid = secrets.token_hex(6)
            spec = ContainerSpec(sid, image, user, cfg, {LABEL_HOME: str(rt.home)})
            try:
                ref = rt.backend.create(spec)  # the row comes after: a death in between leaves an orphan
            except Exception as e:  # noqa: BLE001 - a spare is an optimisation; log and stop
                log.warning("could not make a spare shell: %s", e)
                return
            rt.registry.insert_sandbox(id=sid, state=SPARE, image=image, user=user, config=config,
                                       labels={TEMPLATE_LABEL: key}, container=ref.container,
                                       volume=ref.volume)
    finally:
        with _making_lock:
            _making[key] -= count


def expire(rt, ttl_s: float | None = None, keys: Collection[str] | None = None) -> list[str]:
    """Remove spares older than `ttl_s` (default: the backend's `spare_ttl_s`), of the templates `keys`
    only if given; their ids."""
    ttl = ttl_s if ttl_s is not None else getattr(rt.backend.settings, "spare_ttl_s", 0.0)
    now, gone = time.time(), []
    with file_lock(rt.registry.lock_dir / "spares.lock"):
        for rec in rt.registry.list_sandboxes():
            if rec.state == SPARE and now - rec.created_at > ttl and \
                    (keys is None or rec.labels.get(TEMPLATE_LABEL) in keys):
                rt.backend.remove(ContainerRef(rec.container or "", rec.volume or ""))
                rt.registry.delete_sandbox(rec.id)
                gone.append(rec.id)
    return gone


def discard(rt, keys: Collection[str], wait_s: float = 30.0) -> list[str]:
    """Remove every spare of the templates `keys`, once the ones this process is making are made (at most
    `wait_s`): a pool closed at the end of a run leaves no started shells behind. A spare holds nothing,
    so a fork elsewhere of the same template only starts its shells afresh."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with _making_lock:
            if not any(_making.get(k, 0) for k in keys):
                break
        time.sleep(0.05)
    return expire(rt, ttl_s=0.0, keys=set(keys))
