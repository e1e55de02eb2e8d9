"""`SandboxPool`: many sandboxes under one memory budget, paused to disk when idle, resumed on use.

    pool = SandboxPool("rollouts", memory_budget="4g")      # other values: conf/agentenv/pool.yaml
    sb = pool.create()                # warm start: a fork of the pool's checkpointed ready sandbox
    sb.exec("python3 -c 'print(1)'")  # resumes the sandbox first if the pool had paused it
    group = pool.fork(sb, 8)          # GRPO group: 8 copies of sb's memory and files
    pool.metrics()                    # running, paused, pauses, resumes, p50/p90 latencies, bytes on disk

Budget: before a sandbox is resumed, created or forked, the pool's `residency` (agentenv.pool.residency,
the one owner of what runs) measures the RSS of its running members (cgroup reads) and, while RSS + the
newcomer's expected size exceeds `memory_budget`, pauses the least recently used members that have been
idle for `idle_after_s` and are not in use. When nothing idle is left it goes over budget and counts it
(`strict_budget: true` raises PoolBudgetExceeded instead).

Pause method (`pause_method`): ``criu`` (default) checkpoints a paused member to disk, so it holds no
memory; ``freeze`` freezes it in its cgroup (`Sandbox.freeze`, `docker pause`): no CPU and a resume in
milliseconds, but its memory stays, so it still counts as running for the budget and the budget never
freezes members to make room (it goes over budget instead). Either way the pool counts it as paused
(pauses, resumes, sandbox-seconds) and resumes (thaws) it on its next use.

Warm starts: the first `create()` of an image/config (or of a named template with a `setup` callable,
e.g. a task's reset state) builds that sandbox once, pauses it as the pool's template, and every later
`create()` forks it, paying a restore instead of a cold start and the rebuild of the state.

Concurrency: members, last-use times, leases and events live in a SQLite file per pool name under
$AGENTENV_HOME/pools, budget decisions hold a per-pool file lock, and each state change holds the
sandbox's own lock (the registry's), so threads and processes sharing a pool name cooperate: a sandbox
in use (leased) is never picked for pausing, and a sandbox being paused is resumed, not used, by an exec.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from agentenv import checks, spares
from agentenv.config import SandboxConfig
from agentenv.errors import (
    AgentEnvError,
    CheckpointError,
    SandboxBusy,
    SandboxNotFound,
    SandboxStateError,
    SessionError,
)
from agentenv.locks import sandbox_lock
from agentenv.owner import KEEPER_LABEL
from agentenv.paths import agentenv_home
from agentenv.pool.cpu import OP_CPU
from agentenv.pool.residency import Residency
from agentenv.pool.settings import PoolSettings
from agentenv.pool.state import PoolState
from agentenv.results import ExecResult, SandboxStats
from agentenv.runtime import runtime
from agentenv.sandbox import Sandbox
from agentenv.session import Session

log = logging.getLogger(__name__)

LABEL_POOL = "org.k3rl.agentenv.pool"
LABEL_TEMPLATE = "org.k3rl.agentenv.pool-template"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class PoolMetrics:
    """A snapshot of one pool (all processes using it). Latencies in seconds (NaN: no event yet)."""

    running: int
    paused: int
    templates: int
    pauses: int
    resumes: int
    warm_starts: int
    cold_starts: int
    forks: int
    over_budget: int
    pause_p50_s: float
    pause_p90_s: float
    resume_p50_s: float
    resume_p90_s: float
    warm_start_p50_s: float
    warm_start_p90_s: float
    cold_start_p50_s: float
    memory_used_bytes: int
    memory_budget_bytes: int
    disk_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PooledSandbox:
    """A pool member: a `SandboxHandle` like `Sandbox`. Every use (exec, files, a session's commands, a
    fork) holds a lease on it, so the pool does not pause it meanwhile, and resumes it first when the pool
    had paused it for its budget; a pause asked for through the handle (`pause()`) holds, as a local
    sandbox's does, until `resume()` (or a lease, `pool.using`)."""

    def __init__(self, pool: SandboxPool, sandbox: Sandbox) -> None:
        self.pool = pool
        self.sandbox = sandbox

    @property
    def id(self) -> str:
        return self.sandbox.id

    @property
    def status(self) -> str:
        return self.sandbox.status

    @property
    def reason(self) -> str | None:
        return self.sandbox.reason

    @property
    def labels(self) -> dict[str, str]:
        return self.sandbox.labels

    @property
    def user(self) -> str:
        return self.sandbox.user

    @property
    def parent_id(self) -> str | None:
        return self.sandbox.parent_id

    @property
    def config(self) -> SandboxConfig:
        return self.sandbox.config

    def describe(self) -> dict[str, Any]:
        return {**self.sandbox.describe(), "pool": self.pool.name}

    def exec(self, cmd: str | Sequence[str], timeout: float | None = None, stdin: bytes | str | None = None,
             env: Mapping[str, str] | None = None, workdir: str | None = None,
             raise_on_timeout: bool = False) -> ExecResult:
        checks.command_argv(cmd)  # a bad call is refused before it resumes anything
        checks.timeout_seconds(timeout, 1.0)
        checks.stdin_bytes(stdin)
        checks.exec_env(env)
        checks.exec_workdir(workdir)
        self._usable("exec in")
        with self.pool.using(self) as sb:
            return sb.exec(cmd, timeout=timeout, stdin=stdin, env=env, workdir=workdir,
                           raise_on_timeout=raise_on_timeout)

    def session(self) -> PooledSession:
        """A persistent shell whose every `run` holds a lease (and resumes a member the pool paused)."""
        return PooledSession(self)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        checks.workspace_path(path, self.config.workspace)
        checks.file_payload(data, self.config.file_limit_bytes)
        checks.file_mode(mode)
        self._usable("write files in")
        with self.pool.using(self) as sb:
            sb.write_file(path, data, mode)

    def read_file(self, path: str) -> bytes:
        checks.workspace_path(path, self.config.workspace)
        self._usable("read files from")
        with self.pool.using(self) as sb:
            return sb.read_file(path)

    def _usable(self, action: str) -> None:
        """Refuse a use while a pause asked for through a handle holds (the pool's own pauses do not)."""
        member = self.pool.state.get(self.id)
        if member is not None and member.held_pause and self.pool.paused(self):
            raise SandboxStateError(f"sandbox {self.id} is paused; resume it first (`sandbox.resume()`) "
                                    f"before you {action} it")

    def pause(self) -> None:
        """Pause it now (SandboxStateError when already paused, SandboxBusy while another holder uses it)."""
        if self.pool.paused(self):
            raise SandboxStateError(f"sandbox {self.id} is already paused")
        if self.status != "running":
            self.sandbox.pause()  # refused with the sandbox's own state error (closed, broken)
        if not self.pool.pause(self) and not self.pool.paused(self):
            raise SandboxBusy(f"sandbox {self.id} is in use by another holder of pool {self.pool.name!r}; "
                              "pause it once that use ends")
        self.pool.state.hold_pause(self.id)

    def resume(self) -> None:
        """Resume it (SandboxStateError when it is running)."""
        if not self.pool.paused(self):
            status = self.status
            raise SandboxStateError(f"sandbox {self.id} is already running" if status == "running" else
                                    f"sandbox {self.id} is {status}; cannot resume it")
        self.pool.resume(self)

    def fork(self, n: int, labels: Mapping[str, str] | None = None) -> list[PooledSandbox]:
        return self.pool.fork(self, n, labels=labels)

    def stats(self) -> SandboxStats:
        return self.sandbox.stats()

    def close(self) -> None:
        self.pool.remove(self)

    def __repr__(self) -> str:
        return f"PooledSandbox(id={self.id!r}, pool={self.pool.name!r})"


class PooledSession:
    """The session of a pool member: each `run` leases the member (resuming it when the pool paused it)
    and runs in one shell of it, which a pause ends and the next `run` reopens (`reopened`)."""

    def __init__(self, member: PooledSandbox) -> None:
        self.member = member
        self.reopened = False
        self._shell: Session | None = None
        self._closed = False
        self._lock = threading.Lock()
        member._usable("run commands in")
        with self.member.pool.using(member) as sb:
            self._shell = sb.session()

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, cmd: str | Sequence[str], timeout: float | None = None,
            stdin: bytes | str | None = None) -> ExecResult:
        checks.command_argv(cmd)
        checks.timeout_seconds(timeout, 1.0)
        checks.stdin_bytes(stdin)
        with self._lock:
            if self._closed or self._shell is None:
                raise SessionError(f"this session of sandbox {self.member.id} is closed; open a new one "
                                   "with sandbox.session()")
            self.member._usable("run commands in")
            with self.member.pool.using(self.member):
                result = self._shell.run(cmd, timeout=timeout, stdin=stdin)
            self.reopened = self._shell.reopened
            return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._shell is not None:
                self._shell.close()

    def __enter__(self) -> PooledSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PooledSession(sandbox={self.member.id!r}, pool={self.member.pool.name!r})"


class SandboxPool:
    """See the module docstring."""

    def __init__(
        self,
        name: str = "default",
        settings: PoolSettings | None = None,
        config: SandboxConfig | None = None,
        labels: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> None:
        """`labels` go on every member the pool makes (e.g. `agentenv.owner.owner_labels()` for a pool
        that lives as long as its process); `overrides` are conf/agentenv/pool.yaml keys."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise AgentEnvError(f"pool name must match {_NAME.pattern}, got {name!r}")
        self.name = name
        self.settings = settings or PoolSettings.load(**overrides)
        self.config = config
        self.labels = dict(labels or {})
        home = agentenv_home()
        self.state = PoolState(home / "pools" / f"{name}.sqlite3")
        self._lock_dir = home / "locks"
        self.residency = Residency(self)  # which members run, wait or pause, under the one budget
        self._spare_kinds: set[str] = set()  # templates of the spare shells this pool's forks made

    def _pause_member(self, sandbox: Sandbox) -> bool:
        """Pause a member this caller has claimed (`claim_for_pause`): a CRIU pause ends its session
        shells; with ``pause_method: freeze`` it is frozen instead (the registry keeps it running).
        False, with nothing done, when another caller paused it since this one saw it running."""
        if self._frozen(sandbox.id) if self._freezes else sandbox.status != "running":
            return False
        self._timed("pause", sandbox.freeze if self._freezes else sandbox.pause)
        self.state.mark(sandbox.id, paused=True)
        return True

    def _pause_idle_member(self, sandbox: Sandbox) -> str:
        """Pause an idle member this caller has claimed, for the budget or the idle sweep: "paused";
        "gone" when its owner closed (or removed) it since the registry read, which frees its memory as
        well and is no failure; "kept" when it keeps running (another caller paused it first, or the
        pause failed, e.g. at the disk cap: logged)."""
        error: Exception | None = None
        try:
            if self._pause_member(sandbox):
                return "paused"
        except (CheckpointError, SandboxStateError) as e:
            error = e
        try:
            gone = sandbox.status in ("closed", "broken")
        except SandboxNotFound:
            gone = True
        if gone:
            self.state.drop(sandbox.id)
            return "gone"
        if error is not None:
            log.warning("pool %s: could not pause idle sandbox %s: %s", self.name, sandbox.id, error)
        return "kept"

    @property
    def _freezes(self) -> bool:
        return self.settings.pause_method == "freeze"

    def _frozen(self, sandbox_id: str) -> bool:
        """A member this pool froze (``pause_method: freeze``): paused for the pool, running for Docker."""
        member = self.state.get(sandbox_id)
        return self._freezes and member is not None and bool(member.paused)

    # ---- helpers -----------------------------------------------------------------------------
    def _pool_lock(self, action: str, suffix: str = ""):
        return sandbox_lock(self._lock_dir, f"pool-{self.name}{suffix}", self.settings.lock_timeout_s, action)

    def _timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` and record its wall seconds and the CPU seconds charged to it (`OP_CPU`)."""
        t, token = time.perf_counter(), OP_CPU.start()
        try:
            out = fn()
        except BaseException:
            OP_CPU.stop(token)
            raise
        self.state.record(kind, time.perf_counter() - t, OP_CPU.stop(token))
        return out

    @staticmethod
    def _id(sb: PooledSandbox | Sandbox | str) -> str:
        return sb if isinstance(sb, str) else sb.id

    def get(self, sandbox_id: str) -> PooledSandbox:
        if self.state.get(sandbox_id) is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} is not a member of pool {self.name!r}")
        return PooledSandbox(self, Sandbox.get(sandbox_id))

    def members(self) -> list[PooledSandbox]:
        out = []
        for m in self.state.members():
            try:
                out.append(PooledSandbox(self, Sandbox.get(m.sandbox_id)))
            except SandboxNotFound:
                self.state.drop(m.sandbox_id)
        return out

    # ---- creating ----------------------------------------------------------------------------
    def create(
        self,
        image: str | None = None,
        *,
        template: str | None = None,
        setup: Callable[[Sandbox], None] | None = None,
        labels: Mapping[str, str] | None = None,
        config: SandboxConfig | None = None,
    ) -> PooledSandbox:
        """A new running member: a fork of the template (warm start) or, with warm starts off and no
        `template` name, a fresh sandbox. `setup(sandbox)` brings a new template (or a cold-started
        sandbox) to its ready state, e.g. installs a task; a named `template` is built once per pool.
        `config` (default: the pool's, else conf/sandbox) is the new sandbox's configuration."""
        cfg = (config or self.config or SandboxConfig.load()).replace(image=image)
        user_labels = {**self.labels, **(labels or {}), LABEL_POOL: self.name}
        if self.settings.warm_starts or template is not None:
            key = template or _config_key(cfg)
            tmpl = self._template(key, cfg, setup, user_labels)
            size = tmpl.stats().checkpoint_bytes  # what the fork holds once its pages are in
            self.ensure_budget(size)
            sb = self._timed("warm_start", lambda: tmpl.fork(1)[0])
        else:
            key, size = None, 0
            self.ensure_budget(0)

            def cold() -> Sandbox:
                s = Sandbox.create(config=cfg, labels=user_labels)
                if setup is not None:
                    setup(s)
                return s

            sb = self._timed("cold_start", cold)
        self.state.add(sb.id, rss_bytes=size, template=key)
        return PooledSandbox(self, sb)

    def _template(
        self, key: str, cfg: SandboxConfig, setup: Callable[[Sandbox], None] | None, labels: Mapping[str, str]
    ) -> Sandbox:
        """The pool's paused template for `key`, built (once, across processes) when missing."""
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        with self._pool_lock("build a template", suffix=f"-tmpl-{digest}"):
            sid = self.state.template(key)
            if sid is not None:
                try:
                    sb = Sandbox.get(sid)
                    if sb.status == "paused":
                        return sb
                    if sb.status == "running":
                        sb.pause()
                        return sb
                    sb.close()
                except SandboxNotFound:
                    pass
                self.state.set_template(key, None)

            def build() -> Sandbox:
                sb = Sandbox.create(config=cfg, labels={**labels, LABEL_TEMPLATE: key})
                try:
                    if setup is not None:
                        setup(sb)
                    sb.pause()
                except BaseException:
                    sb.close()
                    raise
                return sb

            sb = self._timed("cold_start", build)
            self.state.set_template(key, sb.id)
            return sb

    # ---- using -------------------------------------------------------------------------------
    @contextmanager
    def _leased(self, sandbox_id: str) -> Iterator[None]:
        deadline = time.monotonic() + self.settings.lock_timeout_s
        while not self.state.lease(sandbox_id, self.settings.lease_timeout_s, self.settings.lock_timeout_s):
            if time.monotonic() > deadline:
                raise SandboxBusy(
                    f"sandbox {sandbox_id} has been being paused for {self.settings.lock_timeout_s} s"
                )
            time.sleep(0.02)
        try:
            yield
        finally:
            self.state.release(sandbox_id)

    @contextmanager
    def using(self, sb: PooledSandbox | Sandbox | str) -> Iterator[Sandbox]:
        """Hold the sandbox (the pool will not pause it meanwhile), resumed if it was paused."""
        sid = self._id(sb)
        with self._leased(sid):
            sandbox = Sandbox.get(sid)
            if sandbox.status == "paused":
                self._resume(sandbox)
            elif self._frozen(sid):
                self._timed("resume", sandbox.thaw)
                self.state.mark(sid, paused=False)
            yield sandbox

    def _resume(self, sandbox: Sandbox) -> None:
        checkpoint = sandbox.stats().checkpoint_bytes  # what it holds once its pages are in
        self.ensure_budget(checkpoint, exclude={sandbox.id})
        t, token = time.perf_counter(), OP_CPU.start()
        try:
            sandbox.resume()
        except SandboxStateError:
            OP_CPU.stop(token)
            if sandbox.status != "running":
                raise
            return  # another thread or process resumed it first
        except BaseException:
            OP_CPU.stop(token)
            raise
        seconds, stats = time.perf_counter() - t, sandbox.stats()
        self.state.record("resume", seconds, OP_CPU.stop(token, restored_cpu_s=stats.cpu_seconds_since_start))
        self.state.mark(sandbox.id, paused=False)
        # the largest since its start, as `_running` keeps it: a lazy restore returns with few pages in
        # and no checkpoint left, so its footprint now would count it at a fraction of its size
        member = self.state.get(sandbox.id)
        self.state.set_rss(sandbox.id, max(checkpoint, footprint(stats), member.rss_bytes if member else 0))

    def exec(self, sb: PooledSandbox | Sandbox | str, cmd: str | list[str], **kwargs: Any) -> ExecResult:
        """`Sandbox.exec` on a member, resuming it first when it is paused."""
        with self.using(sb) as sandbox:
            return sandbox.exec(cmd, **kwargs)

    def resume(self, sb: PooledSandbox | Sandbox | str) -> None:
        """Resume (or thaw) a member the pool paused; nothing when it runs."""
        with self.using(sb):
            pass

    def paused(self, sb: PooledSandbox | Sandbox | str) -> bool:
        """Is the member paused for the pool: checkpointed, or frozen (``pause_method: freeze``)?"""
        sid = self._id(sb)
        return self._frozen(sid) or Sandbox.get(sid).status == "paused"

    def pause(self, sb: PooledSandbox | Sandbox | str) -> bool:
        """Pause a member now unless it is in use (False) or already paused."""
        sid = self._id(sb)
        sandbox = Sandbox.get(sid)
        if sandbox.status != "running" or self._frozen(sid) or not self.state.claim_for_pause(sid):
            return False
        try:
            return self._pause_member(sandbox)
        finally:
            self.state.end_pause(sid)

    def unpaused_reason(self, sb: PooledSandbox | Sandbox | str) -> str:
        """Why `pause` left a member running, as its state row says now (for a warning)."""
        member, now = self.state.get(self._id(sb)), time.time()
        if member is None:
            return "not a member of the pool"
        if member.leased(now):
            return f"in use ({member.leases} lease(s), held {member.lease_until - now:.0f} s more at most)"
        if member.pausing_since:
            return f"another holder has been pausing it for {now - member.pausing_since:.1f} s"
        if self._frozen(member.sandbox_id):
            return "frozen by the pool (pause_method: freeze)"
        return "its pause failed and left it running"

    def fork(self, sb: PooledSandbox | Sandbox | str, n: int,
             labels: Mapping[str, str] | None = None) -> list[PooledSandbox]:
        """n new members with the memory and files of `sb` (room is made for n copies of its RSS). `labels`:
        the forks' labels (default: the source's), to which the pool adds its own."""
        n = checks.fork_count(n)
        given = checks.sandbox_labels(labels)
        sid = self._id(sb)
        with self._leased(sid):
            source = Sandbox.get(sid)
            fork_labels = None if given is None else {**self.labels, **given, LABEL_POOL: self.name}
            source_member = self.state.get(sid)
            size = max(footprint(source.stats()), source_member.rss_bytes if source_member else 0)
            self.ensure_budget(n * size, exclude={sid})
            forks = self._timed("fork", lambda: source.fork(n, labels=fork_labels))
        self._spare_kinds.add(spares.template_key(source.image, source.user, source.config.to_dict()))
        for f in forks:  # a fork holds what its source held once its pages are in
            self.state.add(f.id, rss_bytes=size, template=source_member.template if source_member else None)
        return [PooledSandbox(self, f) for f in forks]

    def keep(self, sb: PooledSandbox | Sandbox | str, labels: Mapping[str, str]) -> Sandbox:
        """Take a paused member out of the pool without closing it: it loses the pool's labels (its
        owner's among them) and gets `labels` (e.g. `agentenv.owner.keeper_labels`), so neither `close()`
        nor gc's orphan rule removes it. Returns it (a plain `Sandbox`)."""
        sid = self._id(sb)
        sandbox = Sandbox.get(sid)
        if sandbox.status != "paused":
            raise SandboxStateError(f"sandbox {sid} is {sandbox.status}; only a paused member can be kept")
        self.state.drop(sid)
        sandbox.relabel(labels, remove=[LABEL_POOL, *self.labels])
        return sandbox

    def restore(self, source: Sandbox | str) -> PooledSandbox:
        """A new running member restored from a paused sandbox outside the pool (e.g. one `keep` took
        out), with the pool's labels; the source stays paused as it is, so it can be restored again."""
        sandbox = Sandbox.get(source) if isinstance(source, str) else source
        if sandbox.status != "paused":
            raise SandboxStateError(
                f"sandbox {sandbox.id} is {sandbox.status}; only a paused one can be restored"
            )
        size = sandbox.stats().checkpoint_bytes
        self.ensure_budget(size)
        labels = {k: v for k, v in sandbox.labels.items() if k != KEEPER_LABEL}
        labels.update({**self.labels, LABEL_POOL: self.name})
        fork = self._timed("fork", lambda: sandbox.fork(1, labels=labels)[0])
        self._spare_kinds.add(spares.template_key(sandbox.image, sandbox.user, sandbox.config.to_dict()))
        self.state.add(fork.id, rss_bytes=size)
        return PooledSandbox(self, fork)

    def remove(self, sb: PooledSandbox | Sandbox | str) -> None:
        """Close a member (container, volume and checkpoint images go) and forget it."""
        sid = self._id(sb)
        try:
            Sandbox.get(sid).close()
        except SandboxNotFound:
            pass
        self.state.drop(sid)

    # ---- the budget --------------------------------------------------------------------------
    def _running(self) -> tuple[list[tuple[Any, Sandbox, int]], int]:
        """[(member, sandbox, rss)] of running members in LRU order, and their RSS in total.

        States come from the registry (cheap); an RSS is re-measured (cgroup) when older than
        `rss_refresh_s`, so a budget check over many members stays fast."""
        running, used, now = [], 0, time.time()
        for m in self.state.members():
            try:
                sb = Sandbox.get(m.sandbox_id)
                status = sb.status
            except SandboxNotFound:
                self.state.drop(m.sandbox_id)
                continue
            if status in ("closed", "broken"):
                self.state.drop(m.sandbox_id)
            elif status == "running":
                rss = m.rss_bytes
                if now - m.rss_at > self.settings.rss_refresh_s:
                    rss = max(m.rss_bytes, footprint(sb.stats()))  # the largest since its start: lazy pages
                    self.state.set_rss(m.sandbox_id, rss)
                running.append((m, sb, rss))
                used += rss
        return running, used

    def running_bytes(self) -> int:
        """RSS held by the running members now (cgroup reads no older than `rss_refresh_s`)."""
        return self._running()[1]

    def member_rss(self, sandbox_ids: Sequence[str]) -> list[int]:
        """The last measured RSS of each of these members (0: not a member or never measured): what
        pausing each would free, for the cost model's count under a budget."""
        out = []
        for sid in sandbox_ids:
            member = self.state.get(sid)
            out.append(member.rss_bytes if member is not None else 0)
        return out

    def sandbox_seconds(self) -> tuple[float, float]:
        """(running, paused) sandbox-seconds of the pool's members so far (see `PoolState.mark`)."""
        return self.state.sandbox_seconds()

    def ensure_budget(self, need: int = 0, exclude: set[str] | frozenset[str] = frozenset()) -> int:
        """Make room for ``need`` bytes: the pool's residency pauses LRU idle members
        (`Residency.make_room`); returns RSS in use after."""
        return self.residency.make_room(need, exclude)

    def pause_idle(self) -> int:
        """Pause every member idle for `idle_after_s` and not in use, budget or not; returns how many."""
        with self._pool_lock("pause idle sandboxes"):
            running, _ = self._running()
            now, n = time.time(), 0
            for m, sb, _rss in running:
                if (
                    not (self._freezes and m.paused)
                    and now - m.last_used >= self.settings.idle_after_s
                    and self.state.claim_for_pause(m.sandbox_id)
                ):
                    try:
                        n += self._pause_idle_member(sb) == "paused"
                    finally:
                        self.state.end_pause(m.sandbox_id)
            return n

    # ---- metrics and shutdown ----------------------------------------------------------------
    def metrics(self) -> PoolMetrics:
        running = paused = used = disk = 0
        for m in self.state.members():
            try:
                st = Sandbox.get(m.sandbox_id).stats()
            except SandboxNotFound:
                continue
            running += st.state == "running"
            paused += st.state == "paused"
            used += st.rss_bytes
            disk += st.checkpoint_bytes
        templates = self.state.templates()
        for sid in templates.values():
            try:
                disk += Sandbox.get(sid).stats().checkpoint_bytes
            except SandboxNotFound:
                continue
        w = self.settings.metrics_window
        pause, resume = self.state.percentiles("pause", w), self.state.percentiles("resume", w)
        warm, cold = self.state.percentiles("warm_start", w), self.state.percentiles("cold_start", w)
        return PoolMetrics(
            running=running,
            paused=paused,
            templates=len(templates),
            pauses=self.state.count("pause"),
            resumes=self.state.count("resume"),
            warm_starts=self.state.count("warm_start"),
            cold_starts=self.state.count("cold_start"),
            forks=self.state.count("fork"),
            over_budget=self.state.count("over_budget"),
            pause_p50_s=pause[0],
            pause_p90_s=pause[1],
            resume_p50_s=resume[0],
            resume_p90_s=resume[1],
            warm_start_p50_s=warm[0],
            warm_start_p90_s=warm[1],
            cold_start_p50_s=cold[0],
            memory_used_bytes=used,
            memory_budget_bytes=self.settings.memory_budget,
            disk_bytes=disk,
        )

    def close(self, templates: bool = True) -> None:
        """Close every member (and the templates, with the spare shells made for their forks and for the
        forks of members, e.g. a tree's branches): containers, volumes and images are removed."""
        for m in self.state.members():
            self.remove(m.sandbox_id)
        if templates:
            rt, kinds = runtime(), set(self._spare_kinds)
            for key, sid in self.state.templates().items():
                rec = rt.registry.get_sandbox(sid)
                if rec is not None:  # its members' forks made spare shells of this kind
                    kinds.add(spares.template_key(rec.image, rec.user, rec.config))
                try:
                    Sandbox.get(sid).close()
                except SandboxNotFound:
                    pass
                self.state.set_template(key, None)
            spares.discard(rt, kinds)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def footprint(stats: SandboxStats) -> int:
    """The memory a running member is counted at: its RSS, or the checkpoint it was restored from when
    that is larger (a lazy restore maps pages as they are touched, so its RSS starts near zero and grows
    to the checkpoint's size; counting the RSS alone would let a budget admit many times too many)."""
    return max(stats.rss_bytes, stats.checkpoint_bytes)


def _config_key(cfg: SandboxConfig) -> str:
    """Templates are per image + configuration: a fork inherits both."""
    blob = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return f"{cfg.image}@{hashlib.sha1(blob.encode()).hexdigest()[:12]}"
