"""`Residency`: the one owner, per `SandboxPool`, of which of its sandboxes run, wait, pause or resume.
It holds the pool's one memory budget (LRU pauses of idle members before a start or resume, and the slots
that make a runner's sandboxes wait for room instead of going over), decides which waiting sandboxes to
pause (`PauseCostModel` is its input) and plans how many episode groups play at once. Everything is keyed
by sandbox handle; a task leases its sandbox per call, so between its calls a sandbox runs unleased.
Remote sandboxes get `NoResidency`: their host decides.
Design: docs/design/sandboxes.md#agentenv-pool-residency.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentenv.errors import PoolBudgetExceeded
from agentenv.pool.cost import MeasuredPool, PauseCostModel, PauseDecision

log = logging.getLogger(__name__)

PARKED, BUSY, EVICTING = "parked", "busy", "evicting"
POLL_S = 0.25  # a waiter re-measures the slots this often (a sandbox's size is measured after its start)
SIZE_REFRESH_S = 1.0  # the members' RSS are re-read from the pool's state at most this often
Submit = Callable[..., Future]


class ResidentPool(MeasuredPool, Protocol):
    """What the residency uses of its pool (an `agentenv.pool.SandboxPool`, which makes its residency)."""

    name: str
    _freezes: bool

    def member_rss(self, sandbox_ids: Sequence[str]) -> list[int]: ...
    def pause(self, sb: Any) -> bool: ...
    def unpaused_reason(self, sb: Any) -> str: ...
    def _pool_lock(self, action: str, suffix: str = "") -> AbstractContextManager[Any]: ...
    def _running(self) -> tuple[list[tuple[Any, Any, int]], int]: ...
    def _pause_idle_member(self, sandbox: Any) -> str: ...


def _key(handle: Any) -> str:
    return handle.id


@dataclass
class Slot:
    """A handle's use of the budget (`Residency.running`): ``held`` when it has a slot, ``waited_s`` spent
    waiting for it. `pause` pauses the sandbox inside the use, so the slot is given back at its end;
    ``handle`` may be set to the sandbox the call left its owner in (a reset's new sandbox, a fork the
    owner goes on in, None: none runs), which keeps the slot from then on."""

    gate: Residency
    handle: Any
    held: bool
    waited_s: float = 0.0
    freed: bool = False

    def pause(self) -> bool:
        """Pause the sandbox now (True: paused by this call); the slot is freed at the end of the use
        when the sandbox no longer runs."""
        paused = self.gate.pause_fn(self.handle)
        self.freed = paused or not self.gate.running_fn(self.handle)
        return paused


@dataclass
class Starting:
    """Slots taken for sandboxes about to start (`Residency.starting`): how many, the seconds waited
    for them, and the handles started (each binds one)."""

    taken: int
    started: list[Any] = field(default_factory=list)
    waited_s: float = 0.0


@dataclass
class Waiting:
    """The sandboxes paused for one wait (`Residency.waiting`): the decision, and how many it paused
    (known once the wait ends)."""

    decision: PauseDecision | None = None
    paused: int = 0
    running_bytes: int = 0


def pause_handle(pool: ResidentPool, handle: Any) -> bool:
    """Pause one member (False: in use, gone, or the pause failed; its next use finds out)."""
    try:
        return pool.pause(handle)
    except Exception as exc:  # e.g. the disk cap or a dead sandbox: it keeps running, or fails later
        log.warning("could not pause waiting sandbox %s: %s", getattr(handle, "id", "?"), exc)
        return False


def handle_running(handle: Any) -> bool:
    """Whether a handle's sandbox runs (holds memory) now; False when there is none or it is gone."""
    try:
        return handle is not None and handle.status == "running"
    except Exception:
        return False


class Residency:
    """See the module docstring. ``pause_fn(handle)`` pauses a sandbox (True: paused by that call),
    ``running_fn(handle)``: whether it runs now (defaults: the pool's pause, the handle's status);
    ``policy``: one of `PAUSE_POLICIES`; ``admission``: whether the slots gate starts and calls (only
    where a pause frees memory: ``pause_method: criu``)."""

    def __init__(
        self,
        pool: ResidentPool,
        pause_fn: Callable[[Any], bool] | None = None,
        running_fn: Callable[[Any], bool] | None = None,
        policy: str = "cost",
        admission: bool = True,
    ) -> None:
        self.pool = pool
        self.pause_fn = pause_fn or (lambda handle: pause_handle(pool, handle))
        self.running_fn = running_fn or handle_running
        self.policy = policy
        self.admission = admission
        self._cost: PauseCostModel | None = None
        self.fallback_bytes = 0  # a sandbox's memory limit, set by its user before the first measurement
        self._cond = threading.Condition()
        self._held: dict[str, str] = {}  # sandbox id -> PARKED | BUSY | EVICTING, one slot each
        self._parked: OrderedDict[str, Any] = OrderedDict()  # parked handles, least recently parked first
        self._busy_by: dict[str, int] = {}  # sandbox id -> the thread using it (BUSY)
        self._anon = 0  # slots taken for sandboxes not started yet (forks, restores being made)
        self._queue: deque[object] = deque()  # waiters, first come first served
        self._demand = 0
        self._size = 0
        self._size_at = -math.inf

    def configure(self, policy: str, admission: bool) -> Residency:
        """Set the pause policy (one of `PAUSE_POLICIES`) and whether the slots gate (the owner's choice,
        e.g. ``rollout.sandbox_pool``); returns self."""
        self.policy, self.admission, self._cost = policy, admission, None
        _ = self.cost  # a bad policy is refused here, and the spare cores are measured from now on
        return self

    @property
    def cost(self) -> PauseCostModel:
        """The cost model of a pause for a wait (made on first use: it reads the host's CPU times)."""
        if self._cost is None:
            self._cost = PauseCostModel(self.pool, self.policy)
        return self._cost

    @property
    def gates(self) -> bool:
        """Whether the slots gate the pool's starts and calls (``admission`` on a CRIU pool)."""
        return self.admission and self.pool.settings.pause_method == "criu"

    # ------------------------------------------------------------------ the budget: idle members
    def make_room(self, need: int = 0, exclude: set[str] | frozenset[str] = frozenset()) -> int:
        """Pause LRU idle members (not leased, idle for `idle_after_s`) until running RSS + ``need`` fits
        the budget; returns the RSS in use after (`SandboxPool.ensure_budget`)."""
        pool, settings = self.pool, self.pool.settings
        budget = settings.memory_budget
        with pool._pool_lock("make room"):
            running, used = pool._running()
            if used + need <= budget:
                return used
            now = time.time()
            for m, sb, rss in [] if pool._freezes else running:  # a frozen member keeps its memory
                if m.sandbox_id in exclude or now - m.last_used < settings.idle_after_s:
                    continue
                if not pool.state.claim_for_pause(m.sandbox_id):
                    continue  # in use right now
                try:
                    if pool._pause_idle_member(sb) != "kept":
                        used -= rss
                finally:
                    pool.state.end_pause(m.sandbox_id)
                if used + need <= budget:
                    return used
            pool.state.record("over_budget", 0.0)
            if settings.strict_budget:
                raise PoolBudgetExceeded(
                    f"pool {pool.name!r}: {used / 2**20:.0f} MiB running + {need / 2**20:.0f} MiB needed "
                    f"exceed the budget of {budget / 2**20:.0f} MiB, and no member that is not in use has "
                    f"been idle for {settings.idle_after_s:g} s; close sandboxes or raise memory_budget"
                )
            return used

    # ------------------------------------------------------------------ the budget: slots
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
        """How many sandboxes may run at once: memory_budget // `sandbox_bytes` (never less than 1)."""
        return max(1, self.pool.settings.memory_budget // self.sandbox_bytes())

    @property
    def binds(self) -> bool:
        """Whether the slots gate and the runs in progress have more episodes than slots."""
        return self.gates and self._demand > self.slots()

    @property
    def playing(self) -> int:
        """Episodes of the runs in progress (`demand`)."""
        return self._demand

    @property
    def waiting_for_slot(self) -> bool:
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

    def _used(self) -> int:
        return len(self._held) + self._anon

    def acquire(self, k: int) -> tuple[int, float]:
        """Take between 1 and ``k`` slots for sandboxes about to start (`bind` each to its handle, or
        `release` them): ``k`` once parked sandboxes are paused to free them, fewer when only running
        calls hold the others. Returns (slots taken, seconds waited: 0.0 when they were free)."""
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
        """Pause the least recently parked sandbox (the lock released meanwhile) to free its slot; True
        when freed. One that still runs after its pause failed (CRIU refused the dump, the disk cap
        refused the checkpoint) keeps its slot, parked again as the most recent: the budget holds, and
        the caller tries again later."""
        key, handle = self._parked.popitem(last=False)
        self._held[key] = EVICTING
        self._cond.release()
        still_running = False
        try:
            self.pause_fn(handle)
            still_running = self.running_fn(handle)
            if still_running:
                log.warning("could not pause parked sandbox %s to free a slot (%s); it keeps its slot",
                            _key(handle), self.pool.unpaused_reason(handle))
        except Exception as exc:  # a dead sandbox holds no memory; its owner's next call finds out
            log.warning("could not pause a parked sandbox to free a slot: %s", exc)
            try:
                still_running = self.running_fn(handle)
            except Exception:  # gone: it holds no memory
                still_running = False
        finally:
            self._cond.acquire()
            if still_running:
                self._held[key] = PARKED
                self._parked[key] = handle
            else:
                del self._held[key]
            self._cond.notify_all()
        return not still_running

    def release(self, n: int) -> None:
        """Give back ``n`` slots taken by `acquire` and not bound (e.g. a fork that failed)."""
        with self._cond:
            self._anon -= n
            self._cond.notify_all()

    def bind(self, handle: Any) -> None:
        """Bind one slot taken by `acquire` to ``handle``, whose sandbox now runs: parked from now on
        (None: nothing was started that runs, the slot is given back)."""
        with self._cond:
            self._anon -= 1
            if handle is not None:
                self._park_locked(_key(handle), handle)
            self._cond.notify_all()

    def _park_locked(self, key: str, handle: Any) -> None:
        if self._held.get(key) == PARKED:  # one slot per sandbox: a second one is given back
            self._parked.move_to_end(key)
            return
        self._held[key] = PARKED
        self._parked[key] = handle

    def _claim_locked(self, key: str | None) -> bool:
        """Take ``key``'s parked slot for this thread (True), after any pause or other use of it in
        progress ends (False: it holds no slot)."""
        if key is None:
            return False
        while self._held.get(key) in (EVICTING, BUSY):
            if self._busy_by.get(key) == threading.get_ident():
                raise RuntimeError("a use of a sandbox nested in another use of it (same thread)")
            self._cond.wait(POLL_S)
        if self._held.get(key) == PARKED:
            del self._parked[key]
            self._held[key] = BUSY
            self._busy_by[key] = threading.get_ident()
            return True
        return False

    @contextmanager
    def running(self, handle: Any, need_slot: bool = True) -> Iterator[Slot]:
        """A call on ``handle``'s sandbox (None: its owner has none yet) in the block: with its parked
        slot, or a new one (waiting, and pausing parked sandboxes, as `acquire`) when ``need_slot`` (the
        block runs a sandbox). At the end the slot is parked again on ``Slot.handle``, or freed when the
        block paused or closed the sandbox (``Slot.freed``) or left its owner with none. Not gating: a
        slot that holds nothing."""
        if not self.gates:
            yield Slot(self, handle, held=False)
            return
        key = None if handle is None else _key(handle)
        with self._cond:
            held = self._claim_locked(key)
        slot = Slot(self, handle, held)
        if not held and need_slot:
            _, slot.waited_s = self.acquire(1)
            with self._cond:
                self._anon -= 1
                slot.held = True
                if key is None:
                    self._anon += 1  # not bound to a sandbox until the block gives it one
                else:
                    self._held[key] = BUSY
                    self._busy_by[key] = threading.get_ident()
        try:
            yield slot
        finally:
            self._end(slot, key)

    def _end(self, slot: Slot, key: str | None) -> None:
        """The end of a `running` call: the slot is parked again (on the handle the block left), or freed."""
        if not slot.held:
            return
        with self._cond:
            if key is None:
                self._anon -= 1
            else:
                self._busy_by.pop(key, None)
                del self._held[key]
            if not slot.freed and slot.handle is not None:
                self._park_locked(_key(slot.handle), slot.handle)
            self._cond.notify_all()

    @contextmanager
    def starting(self, k: int) -> Iterator[Starting]:
        """Slots for up to ``k`` sandboxes the block starts (fork, restore): yields a `Starting` (``k``
        slots when not gating). Each handle the block appends to its ``started`` gets one of the slots;
        the rest, or all of them if the block raises, are given back."""
        if not self.gates:
            yield Starting(k)
            return
        taken, waited = self.acquire(k)
        start = Starting(taken, waited_s=waited)
        try:
            yield start
        except BaseException:
            self.release(taken)
            raise
        for handle in start.started:
            self.bind(handle)
        if taken > len(start.started):
            self.release(taken - len(start.started))

    def pause(self, handle: Any) -> bool:
        """Pause ``handle``'s sandbox for a wait (True: paused by this call), freeing its slot if it
        held one."""
        with self._cond:
            held = self._claim_locked(_key(handle))
        if not held:
            return self.pause_fn(handle)
        slot = Slot(self, handle, held=True)
        try:
            return slot.pause()
        finally:
            self._end(slot, _key(handle))

    def parked(self, handle: Any) -> bool:
        """Whether ``handle`` holds a parked slot now (its sandbox runs between its calls)."""
        if handle is None:
            return False
        with self._cond:
            return self._held.get(_key(handle)) == PARKED

    def held(self) -> int:
        """Slots held now (running, parked, being paused, or taken for a start)."""
        with self._cond:
            return self._used()

    # ------------------------------------------------------------------ waiting sandboxes
    @contextmanager
    def waiting(self, handles: Sequence[Any], expected_wait_s: float, submit: Submit) -> Iterator[Waiting]:
        """While the sandboxes of ``handles`` wait ``expected_wait_s`` (the block), pause those the cost
        model picks (the largest first), in the background through ``submit`` (an executor's): a
        binding budget keeps the ones that run (they hold slots within it and call first afterwards).
        The `Waiting` it yields counts the pauses once the block ends."""
        out = Waiting()
        handles = [h for h in handles if h is not None]  # a discarded one: nothing to pause
        if not handles:
            yield out
            return
        pool = self.pool
        out.running_bytes = used = pool.running_bytes()
        sizes = pool.member_rss([getattr(h, "id", "") for h in handles])
        out.decision = self.cost.decide(expected_wait_s, used, len(handles), sizes)
        count = out.decision.count
        gating = self.gates
        if out.decision.reason == "cost" and gating and self.binds:
            # a binding budget: the running sandboxes hold slots within it, and they step first after
            # the wait (no resume); the turn's steps pause and resume every episode beyond the slots on
            # busy cores, so pausing these for the wait would only add a pause and a resume to them
            count = 0
        pause = self.pause if gating else self.pause_fn  # `pause` frees their slots
        largest = sorted(range(len(handles)), key=lambda i: sizes[i], reverse=True)[:count]
        jobs = [submit(pause, handles[i]) for i in largest]
        try:
            yield out
        finally:
            out.paused = sum(job.result() for job in jobs)
            if out.paused:
                out.running_bytes = pool.running_bytes()

    # ------------------------------------------------------------------ planning
    def plan(self, group_size: int, remaining: int, expected_wait_s: Callable[[int], float],
             cores: int) -> int:
        """Whole groups (at least one) to play at once, out of the ``remaining`` ones of ``group_size``.

        All of them, except when gating and they outnumber the free slots (`slots` less the episodes
        other runs play). Then either waves of the groups the free slots fit, which never pause, each
        turn taking one expected generation time ``wait`` per wave; or all at once, where each turn
        pauses and resumes the ``beyond`` episodes that do not fit: a turn then takes the longer of the
        wait and those pauses' and resumes' CPU spread over ``cores``, plus one pause + resume in wall
        time (the pool's measured p50s, `PauseCostModel`):

            all at once  when  max(wait, beyond × cpu_s / cores) + cost_s  <  waves × wait

        ``pause_policy=never`` always plays waves, ``always`` all at once."""
        if not self.gates:
            return remaining
        free = self.slots() - self.playing
        fit = max(1, free // group_size)
        beyond = remaining * group_size - free
        if remaining <= fit or self.cost.policy == "always":  # (all fit: beyond <= 0 too)
            return remaining
        if self.cost.policy == "never":
            return fit
        wait = expected_wait_s(remaining * group_size)
        turn_at_once = max(wait, beyond * self.cost.cpu_s() / cores) + self.cost.cost_s()
        return remaining if turn_at_once < math.ceil(remaining / fit) * wait else fit

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, int]:
        """Slots (0: not gating), slots held now and the episodes of the runs in progress."""
        if not self.gates:
            return {"slots": 0, "held": 0, "playing": self.playing}
        return {"slots": self.slots(), "held": self.held(), "playing": self.playing}


class NoResidency:
    """The residency of sandboxes whose host decides (remote `agentenv serve` hosts): nothing waits,
    nothing is paused or planned here."""

    pool = None
    gates = binds = waiting_for_slot = False
    fallback_bytes = 0

    @contextmanager
    def running(self, handle: Any, need_slot: bool = True) -> Iterator[Slot]:
        yield Slot(self, handle, held=False)  # type: ignore[arg-type]

    @contextmanager
    def demand(self, episodes: int) -> Iterator[None]:
        yield

    def parked(self, handle: Any) -> bool:
        return False

    @contextmanager
    def waiting(self, handles: Sequence[Any], expected_wait_s: float, submit: Submit) -> Iterator[Waiting]:
        yield Waiting()

    def plan(self, group_size: int, remaining: int, expected_wait_s: Callable[[int], float],
             cores: int) -> int:
        return remaining

    @contextmanager
    def starting(self, k: int) -> Iterator[Starting]:
        yield Starting(k)

    def metrics(self) -> dict[str, int]:
        return {"slots": 0, "held": 0, "playing": 0}
