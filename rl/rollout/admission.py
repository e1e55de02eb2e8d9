"""`SandboxGate`: admission control that keeps a runner's running sandboxes within its pool's budget.

The pool (`agentenv.SandboxPool`) keeps its budget by pausing idle members before a create, fork or
resume; a member an episode holds (leased, between its steps) is not idle, so when every episode of a
rollout starts or steps at once the pool goes over budget instead of waiting. The gate makes the runner
wait instead: a sandbox of one of its envs may run only while the env holds one of ``slots`` slots,

    slots = max(1, memory_budget // size of one running sandbox)

where the size is the median of the RSS the pool last measured of each member (robust to a misread
cgroup; before the first measurement: the sandbox's memory limit, an upper bound). An env takes a slot
before its sandbox runs (reset, step: the resume happens inside, fork: one slot per new sandbox,
restore) and gives it back once its sandbox is paused; between its turns an env whose sandbox still
runs keeps its slot *parked*. A thread that needs slots while none is free pauses parked sandboxes
(least recently parked first) to free them, and otherwise waits (first come, first served) for a slot
that a running step or start will give back. So no slot is held across a generation that a waiter
could not take back, a waiter never holds a slot while it waits (no hold-and-wait), and every slot held
by a running step comes back when the step ends.

Envs are keyed by ``id``; every call that touches an env's sandbox from the runner goes through `use`
or `pause`, so that a parked env is paused by one thread at a time and never while its owner uses it.
The gate is shared by every thread of one runner (a rollout worker plays one run at a time, while a
snapshot of the episodes in flight pauses and forks from another thread) and by all its runs:
``demand`` counts the episodes of the runs in progress, and the budget *binds* when it exceeds
``slots``.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from agentenv.pool import SandboxPool

log = logging.getLogger(__name__)

PARKED, BUSY, EVICTING = "parked", "busy", "evicting"
POLL_S = 0.25  # a waiter re-measures the slots this often (a sandbox's size is measured after its start)
SIZE_REFRESH_S = 1.0  # the members' RSS are re-read from the pool's state at most this often


@dataclass
class Slot:
    """An env's use of the gate (`SandboxGate.use`): ``held`` when it has a slot, ``waited_s`` spent
    waiting for it; `pause` pauses the env's sandbox inside the use, so the slot is given back at its end."""

    gate: SandboxGate
    env: Any
    held: bool
    waited_s: float = 0.0
    freed: bool = False

    def pause(self) -> bool:
        """Pause the env's sandbox now (True: paused by this call); the slot is freed at the end of the
        use when the sandbox no longer runs."""
        paused = self.gate.pause_fn(self.env)
        self.freed = paused or not self.gate.running_fn(self.env)
        return paused


class SandboxGate:
    """See the module docstring. ``pause_fn(env)`` releases and pauses an env's sandbox (True: paused by
    that call); ``running_fn(env)``: whether its sandbox runs (holds memory) now."""

    def __init__(
        self, pool: SandboxPool, pause_fn: Callable[[Any], bool], running_fn: Callable[[Any], bool]
    ) -> None:
        self.pool = pool
        self.pause_fn = pause_fn
        self.running_fn = running_fn
        self.fallback_bytes = 0  # a sandbox's memory limit, set by the runner from its first env
        self._cond = threading.Condition()
        self._held: dict[int, str] = {}  # id(env) -> PARKED | BUSY | EVICTING, one slot each
        self._parked: OrderedDict[int, Any] = OrderedDict()  # parked envs, least recently parked first
        self._busy_by: dict[int, int] = {}  # id(env) -> the thread using it (BUSY)
        self._anon = 0  # slots taken for sandboxes not bound to an env yet (forks, restores being made)
        self._queue: deque[object] = deque()  # waiters, first come first served
        self._demand = 0
        self._size = 0
        self._size_at = -math.inf

    # ------------------------------------------------------------------ measurements
    def sandbox_bytes(self) -> int:
        """The size one running sandbox is counted at: the median of the RSS the pool last measured of
        each member (robust to a misread cgroup; re-read at most every SIZE_REFRESH_S), else
        `fallback_bytes` (at least 1 byte)."""
        now = time.monotonic()
        if self._size and now - self._size_at < SIZE_REFRESH_S:
            return self._size
        members = self.pool.state.members()
        sizes = [m.rss_bytes for m in members if m.rss_bytes > 0]
        if not sizes and members:  # members exist but none measured yet: measure the running ones now
            self.pool.running_bytes()
            sizes = [m.rss_bytes for m in self.pool.state.members() if m.rss_bytes > 0]
        if sizes:
            self._size, self._size_at = int(statistics.median(sizes)), now
            return self._size
        return max(1, self.fallback_bytes)

    def slots(self) -> int:
        """How many of the runner's sandboxes may run at once (never less than 1)."""
        return max(1, self.pool.settings.memory_budget // self.sandbox_bytes())

    @property
    def binds(self) -> bool:
        """Whether the runs in progress have more episodes than slots (the budget limits them)."""
        return self._demand > self.slots()

    @property
    def playing(self) -> int:
        """Episodes of the runs in progress (`demand`)."""
        return self._demand

    @property
    def waiting(self) -> bool:
        """Whether a thread is waiting for a slot now."""
        return bool(self._queue)

    @contextmanager
    def demand(self, episodes: int) -> Iterator[None]:
        """Count ``episodes`` of a run in progress for `binds`."""
        with self._cond:
            self._demand += episodes
        try:
            yield
        finally:
            with self._cond:
                self._demand -= episodes

    # ------------------------------------------------------------------ slots
    def _used(self) -> int:
        return len(self._held) + self._anon

    def acquire(self, k: int) -> tuple[int, float]:
        """Take between 1 and ``k`` slots for sandboxes about to start (`bind` each to its env, or
        `release` them): ``k`` once parked sandboxes are paused to free them, fewer when only running
        steps hold the others. Returns (slots taken, seconds waited: 0.0 when they were free)."""
        ticket, started, waited = object(), time.perf_counter(), False
        with self._cond:
            self._queue.append(ticket)
            try:
                while True:
                    if self._queue[0] is ticket:
                        free = self.slots() - self._used()
                        if free >= k or (free >= 1 and not self._parked):
                            taken = min(k, free)
                            self._anon += taken
                            return taken, time.perf_counter() - started if waited else 0.0
                        if self._parked:
                            waited = True
                            if not self._evict_locked():
                                self._cond.wait(POLL_S)  # its pause failed: let it be, try again later
                            continue
                    waited = True
                    self._cond.wait(POLL_S)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _evict_locked(self) -> bool:
        """Pause the least recently parked env's sandbox (the lock released meanwhile) to free its slot;
        True when freed. A sandbox that still runs after its pause failed (CRIU refused the dump, the
        disk cap refused the checkpoint) keeps its slot, parked again as the most recent: the budget
        holds, and the caller tries again later."""
        key, env = self._parked.popitem(last=False)
        self._held[key] = EVICTING
        self._cond.release()
        still_running = False
        try:
            self.pause_fn(env)
            still_running = self.running_fn(env)
            if still_running:
                log.warning("could not pause a parked sandbox to free a slot; it keeps its slot")
        except Exception as exc:  # a dead sandbox holds no memory; its env's next step finds out
            log.warning("could not pause a parked sandbox to free a slot: %s", exc)
            try:
                still_running = self.running_fn(env)
            except Exception:  # gone: it holds no memory
                still_running = False
        finally:
            self._cond.acquire()
            if still_running:
                self._held[key] = PARKED
                self._parked[key] = env
            else:
                del self._held[key]
            self._cond.notify_all()
        return not still_running

    def release(self, n: int) -> None:
        """Give back ``n`` slots taken by `acquire` and not bound (e.g. a fork that failed)."""
        with self._cond:
            self._anon -= n
            self._cond.notify_all()

    def bind(self, env: Any) -> None:
        """Bind one slot taken by `acquire` to ``env``, whose sandbox now runs: parked from now on."""
        with self._cond:
            self._anon -= 1
            self._held[id(env)] = PARKED
            self._parked[id(env)] = env
            self._cond.notify_all()

    def _claim_locked(self, key: int) -> bool:
        """Take ``key``'s parked slot for this thread (True), after any pause or other use of it in
        progress ends (False: it holds no slot)."""
        while self._held.get(key) in (EVICTING, BUSY):
            if self._busy_by.get(key) == threading.get_ident():
                raise RuntimeError("an env's use of the gate nested in another use of it (same thread)")
            self._cond.wait(POLL_S)
        if self._held.get(key) == PARKED:
            del self._parked[key]
            self._held[key] = BUSY
            self._busy_by[key] = threading.get_ident()
            return True
        return False

    @contextmanager
    def use(self, env: Any, need_slot: bool = True) -> Iterator[Slot]:
        """Use ``env``'s sandbox in the block: with its parked slot, or a new one (waiting, and pausing
        parked sandboxes, as `acquire`) when ``need_slot`` (the block runs its sandbox). At the end the
        slot is parked again, or freed when the block paused or closed the sandbox (``Slot.freed``)."""
        key = id(env)
        with self._cond:
            held = self._claim_locked(key)
        slot = Slot(self, env, held)
        if not held and need_slot:
            _, slot.waited_s = self.acquire(1)
            with self._cond:
                self._anon -= 1
                self._held[key] = BUSY
                self._busy_by[key] = threading.get_ident()
            slot.held = True
        try:
            yield slot
        finally:
            self._end(slot)

    def _end(self, slot: Slot) -> None:
        """The end of a use: the slot is parked again, or freed when its sandbox no longer runs."""
        if not slot.held:
            return
        key = id(slot.env)
        with self._cond:
            self._busy_by.pop(key, None)
            if slot.freed:
                del self._held[key]
            else:
                self._held[key] = PARKED
                self._parked[key] = slot.env
            self._cond.notify_all()

    def pause(self, env: Any) -> bool:
        """Pause ``env``'s sandbox for a wait (True: paused by this call) and free its slot if it held one."""
        with self._cond:
            held = self._claim_locked(id(env))
        if not held:
            return self.pause_fn(env)
        slot = Slot(self, env, held=True)
        try:
            return slot.pause()
        finally:
            self._end(slot)

    def parked(self, env: Any) -> bool:
        """Whether ``env`` holds a parked slot now (its sandbox runs between its turns)."""
        with self._cond:
            return self._held.get(id(env)) == PARKED

    def held(self) -> int:
        """Slots held now (running, parked, being paused, or taken for a start)."""
        with self._cond:
            return self._used()
