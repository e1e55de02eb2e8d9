"""The time-to-live reaper: a running sandbox whose TTL ran out is paused (created with `autoPause`)
or killed, as E2B does; and, less often, the liveness sweep (`agentenv.server.reconcile.sweep`). One daemon
thread; every action holds the sandbox's lock."""

from __future__ import annotations

import logging
import threading
import time

from agentenv.errors import AgentEnvError, SandboxNotFound
from agentenv.moves import MOVING
from agentenv.sandbox import Sandbox
from agentenv.server.reconcile import sweep
from agentenv.server.store import E2BStore

log = logging.getLogger(__name__)
NEVER = 253402300799.0  # paused sandboxes do not expire


def reap_once(store: E2BStore, now: float | None = None) -> list[tuple[str, str]]:
    """Act on every expired sandbox once; returns (sandbox id, 'paused' | 'killed' | 'forgotten')."""
    now = time.time() if now is None else now
    done = []
    for sid in store.expired(now):
        rec = store.get(sid)
        if rec is None:
            continue
        try:
            sb = Sandbox.get(sid)
            status = sb.status
        except SandboxNotFound:
            store.delete(sid)
            done.append((sid, "forgotten"))
            continue
        rec = store.get(sid)  # again, after the status: a connect sets a new end before it resumes
        if rec is None or rec.end_at > now:
            continue
        try:
            if status == "running" and rec.auto_pause:
                sb.pause()
                store.set_end(sid, NEVER)
                done.append((sid, "paused"))
            elif status in ("paused", MOVING):  # a move keeps it paused here until it runs there
                store.set_end(sid, NEVER, only_if_ended_by=now)  # unless a connect set a new end
            else:
                sb.close()
                store.delete(sid)
                done.append((sid, "killed"))
        except AgentEnvError as e:
            # e.g. a checkpoint that CRIU refused: the sandbox keeps running; retry on the next round.
            log.warning("TTL of sandbox %s ran out but it could not be %s: %s", sid,
                        "paused" if rec.auto_pause else "killed", e)
    return done


class Reaper:
    """Runs `reap_once` every `interval_s` seconds, and `reconcile.sweep` (running sandboxes whose
    container died: forgotten, so lists stop showing them) every `liveness_s` seconds, until `stop()`."""

    def __init__(self, store: E2BStore, interval_s: float, liveness_s: float | None = None) -> None:
        self.store = store
        self.interval_s = interval_s
        self.liveness_s = liveness_s
        self._next_sweep = time.monotonic() + (liveness_s or 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentenv-ttl-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                for sid, what in reap_once(self.store):
                    log.info("sandbox %s: time to live ran out, %s", sid, what)
            except Exception:  # keep reaping after an unexpected error (e.g. dockerd restarting)
                log.exception("TTL reaper round failed")
            if self.liveness_s is not None and time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + self.liveness_s
                try:
                    sweep(self.store)
                except AgentEnvError as e:  # dockerd restarting: the next round looks again
                    log.warning("liveness check skipped: %s", e)
                except Exception:
                    log.exception("liveness check failed")
