"""`SandboxTask`: the base of every agent task, a gymnasium env whose world lives in an AgentENV sandbox.

A task subclasses it and writes three methods:

- ``setup(seed) -> str``: prepare the sandbox for a new episode (deterministically from ``seed``) and
  return the first observation;
- ``act(action) -> Outcome``: carry out the agent's action in the sandbox and say what it saw;
- ``reward(outcome) -> float``: the reward for that step (default: ``1.0`` when ``outcome.success``).

The base owns the sandbox: it is created on the first ``reset`` and **kept alive across episodes**
(each ``reset`` re-runs ``setup`` inside the running sandbox, which is far cheaper than a new
container), paused/resumed on request, forked with the episode state for identical GRPO group starts,
and closed by ``close()``. Commands go through a persistent shell (``Sandbox.session()``, with exec's
output caps and process-group timeouts) unless the task is built with ``session=False`` (one exec per
command). Observations and actions are gymnasium ``Text`` spaces.

With ``pool=`` (an ``agentenv.SandboxPool``) the sandbox is a pool member: created by ``pool.create``
(a warm start, when the pool's ``warm_starts`` is on: a fork of the pool's template, a sandbox that ran
``install()`` once) and leased with ``pool.using`` from ``reset`` until the episode ends (or
``release_sandbox()``), so the pool never pauses it mid-episode, and resumes it first when it had paused
it. One lease per episode, not per step: a lease is a transaction on the pool's SQLite file. A pause (by
the task, the pool or another process) ends the sandbox's session shell; the next command opens a new one.

Episode state that ``fork`` must carry lives in plain attributes holding immutable values (ints,
strings, tuples): a fork is a shallow copy of the env bound to the forked sandbox.
"""

from __future__ import annotations

import copy
import hashlib
import json
import string
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import gymnasium as gym
from gymnasium.spaces import Text

if TYPE_CHECKING:
    from agentenv import Sandbox, SandboxConfig
    from agentenv.pool import SandboxPool
    from agentenv.session import Session

TEXT_CHARSET = frozenset(string.printable)


@dataclass
class Outcome:
    """What one action did: the observation text, whether the episode is over, and if it succeeded."""

    observation: str
    done: bool = False
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class CommandResult:
    """One command run in the sandbox (session or exec): exit code, stdout and stderr merged in the order
    the command wrote them (capped at the sandbox's ``output_limit_bytes``, ``truncated`` then set), and
    whether the timeout killed it."""

    exit_code: int
    output: str
    duration_s: float
    timed_out: bool = False
    truncated: bool = False


class SandboxTask(gym.Env[str, str]):
    """Base class of sandboxed text tasks (see the module docstring).

    Keyword arguments (all come from the task's Hydra config ``env.kwargs``):
    ``max_turns``: the episode is truncated after this many actions;
    ``sandbox``: keyword arguments of ``Sandbox.create`` (``image``, ``memory``, ``cpus``, ``labels``,
    ``config`` as a `SandboxConfig` or the dict of every key, e.g. the Hydra ``sandbox`` group), plus
    ``hosts``: a list of ``agentenv serve`` URLs: the sandbox is then created on the one with the most free
    memory through ``agentenv.remote`` (API key ``$AGENTENV_API_KEY``; limits are the host's config);
    ``session``: talk to the sandbox through a persistent shell (True) or one exec per command (False);
    ``max_observation_chars`` / ``max_action_chars``: sizes of the ``Text`` spaces;
    ``command_timeout_s``: per-command timeout;
    ``pool``: an ``agentenv.SandboxPool`` to take the sandbox from (passed by the trainer, not Hydra).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        max_turns: int = 8,
        sandbox: dict | None = None,
        session: bool = True,
        max_observation_chars: int = 2048,
        max_action_chars: int = 256,
        command_timeout_s: float = 30.0,
        pool: SandboxPool | None = None,
    ) -> None:
        super().__init__()
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if pool is not None and (sandbox or {}).get("hosts"):
            raise ValueError("sandbox.hosts (remote sandboxes) cannot be combined with a local SandboxPool")
        self.max_turns = max_turns
        self.sandbox_kwargs = dict(sandbox or {})
        self.use_session = session
        self.command_timeout_s = command_timeout_s
        self.observation_space = Text(min_length=0, max_length=max_observation_chars, charset=TEXT_CHARSET)
        self.action_space = Text(min_length=0, max_length=max_action_chars, charset=TEXT_CHARSET)
        self.sandbox = None
        self.pool = pool
        self._live = None  # the `Sandbox` leased from the pool (see `hold_sandbox`)
        self._lease = None  # the open `pool.using(...)` context
        self._session: Session | None = None
        self.turn = 0
        self.episode_seed: int | None = None
        self.command_count = 0
        self.command_seconds = 0.0

    # ----------------------------------------------------------------- hooks for subclasses
    def setup(self, seed: int) -> str:
        """Prepare the sandbox for a new episode and return the first observation."""
        raise NotImplementedError

    def act(self, action: str) -> Outcome:
        """Carry out ``action`` in the sandbox."""
        raise NotImplementedError

    def reward(self, outcome: Outcome) -> float:
        """Reward of one step; by default 1 for the step that solves the task, else 0."""
        return 1.0 if outcome.success else 0.0

    def install(self) -> None:
        """Called once per sandbox, after creation, to put the task's programs in place (optional)."""

    # ----------------------------------------------------------------- gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        if seed is None:
            seed = int(self.np_random.integers(0, 2**31 - 1))
        self.ensure_sandbox()
        self.turn = 0
        self.episode_seed = seed
        self.hold_sandbox()
        observation = self.clean(self.setup(seed))
        return observation, {"turn": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.episode_seed is None:
            raise RuntimeError("call reset() before step()")
        self.turn += 1
        self.hold_sandbox()
        outcome = self.act(str(action))
        reward = float(self.reward(outcome))
        terminated = bool(outcome.done or outcome.success)
        truncated = (not terminated) and self.turn >= self.max_turns
        if terminated or truncated:
            self.release_sandbox()
        info = {"turn": self.turn, "success": bool(outcome.success), **outcome.info}
        return self.clean(outcome.observation), reward, terminated, truncated, info

    def close(self) -> None:
        self.release_sandbox()
        self._close_session()
        if self.sandbox is not None:
            try:
                self.sandbox.close()
            finally:
                self.sandbox = None

    # ----------------------------------------------------------------- sandbox plumbing
    def ensure_sandbox(self) -> None:
        """Create the sandbox (and install the task's programs) unless one is live already."""
        if self.pool is not None:
            self._ensure_pooled_sandbox()
            return
        if self.sandbox is not None and self.sandbox.status == "paused":
            self.resume()
        if self.sandbox is None or self.sandbox.status in ("closed", "broken"):
            from agentenv import Sandbox, SandboxConfig

            self._close_session()
            kwargs = dict(self.sandbox_kwargs)
            hosts = kwargs.pop("hosts", None)
            if isinstance(kwargs.get("config"), dict):
                kwargs["config"] = SandboxConfig.from_dict(kwargs["config"])
            if hosts:
                from agentenv.remote import shared_hosts

                self.sandbox = shared_hosts(list(hosts)).create(**kwargs)
            else:
                self.sandbox = Sandbox.create(**kwargs)
            self.install()

    def sandbox_config(self) -> SandboxConfig:
        """The `SandboxConfig` of this task's sandboxes (``sandbox`` kwargs: config, image, memory, cpus)."""
        from agentenv import SandboxConfig

        kwargs = self.sandbox_kwargs
        unknown = sorted(set(kwargs) - {"config", "image", "memory", "cpus", "labels"})
        if unknown:
            raise ValueError(f"unknown sandbox option(s) {unknown}; use config, image, memory, cpus, labels")
        config = kwargs.get("config")
        if isinstance(config, dict):
            config = SandboxConfig.from_dict(config)
        return (config or SandboxConfig.load()).replace(
            image=kwargs.get("image"), memory=kwargs.get("memory"), cpus=kwargs.get("cpus")
        )

    def _ensure_pooled_sandbox(self) -> None:
        """A pool member for this task: a warm start from the pool's template of this task and config."""
        if self.sandbox is not None and self.sandbox.status not in ("closed", "broken"):
            return  # a paused member is resumed by `hold_sandbox()`
        self.release_sandbox()
        self._close_session()
        if self.sandbox is not None:
            self.pool.remove(self.sandbox)
        config = self.sandbox_config()
        task = f"{type(self).__module__}.{type(self).__qualname__}"
        digest = hashlib.sha1(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
        warm = self.pool.settings.warm_starts
        self.sandbox = self.pool.create(
            template=f"{task}@{digest[:12]}" if warm else None,
            setup=self._install_into,
            labels=self.sandbox_kwargs.get("labels"),
            config=config,
        )

    def _install_into(self, sandbox: Sandbox) -> None:
        """`install()` into a new pool template (whose session is closed: the template is not ours)."""
        previous = self.sandbox, self._live
        self.sandbox = self._live = sandbox
        try:
            self.install()
        finally:
            self._close_session()
            self.sandbox, self._live = previous

    def hold_sandbox(self) -> None:
        """Lease the pool member until `release_sandbox()` (no-op without a pool, or when held): the
        pool does not pause it meanwhile, and resumes it first if it had paused it."""
        if self.pool is None or self._live is not None:
            return
        lease = self.pool.using(self.sandbox)
        self._live = lease.__enter__()
        self._lease = lease

    def release_sandbox(self) -> None:
        """Give the pool member back to the pool: idle from now on, it may be paused (no-op if not held)."""
        if self._lease is None:
            return
        lease, self._lease, self._live = self._lease, None, None
        lease.__exit__(None, None, None)

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run a shell command line in the sandbox, stderr merged into its output (the session's shell, or
        one exec); at ``timeout`` (default ``command_timeout_s``) its whole process group is killed."""
        timeout = timeout or self.command_timeout_s
        started = time.perf_counter()
        self.hold_sandbox()
        sandbox = self._live or self.sandbox
        line = f"( {command} ) 2>&1"
        r = self._session_in(sandbox).run(line, timeout=timeout) if self.use_session else \
            sandbox.exec(line, timeout=timeout)
        self.command_count += 1
        self.command_seconds += time.perf_counter() - started
        return CommandResult(r.exit_code, r.stdout, r.duration_s, r.timed_out, r.truncated)

    def _session_in(self, sandbox: Sandbox) -> Session:
        """This env's session in ``sandbox`` (a new one when the env moved to another sandbox)."""
        if self._session is None or self._session.closed or self._session.sandbox.id != sandbox.id:
            self._close_session()
            self._session = sandbox.session()
        return self._session

    def _close_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def pause(self) -> float:
        """Checkpoint the sandbox to disk (no memory, no CPU while paused); returns seconds taken.

        A pool member is released and paused through its pool."""
        self.release_sandbox()
        started = time.perf_counter()
        self.sandbox.pause()
        return time.perf_counter() - started

    def resume(self) -> float:
        """Bring a paused sandbox back; returns seconds taken."""
        started = time.perf_counter()
        self.sandbox.resume()
        return time.perf_counter() - started

    @property
    def paused(self) -> bool:
        return self.sandbox is not None and self.sandbox.status == "paused"

    def fork(self, n: int) -> list[SandboxTask]:
        """``n`` copies of this env in the current episode state, each bound to a fork of the sandbox.

        Used for GRPO groups: reset once, fork G-1 times, and every member starts from the same
        sandbox memory and files (the first observations are byte-identical).
        """
        if self.sandbox is None:
            raise RuntimeError("reset() the env before forking it")
        if self.pool is None:
            sandboxes = self.sandbox.fork(n)
        else:
            if not self.paused:  # a paused member (e.g. paused for the pool's budget) is forked from
                self.hold_sandbox()  # its checkpoint as it is, not resumed first
            sandboxes = self.pool.fork(self._live or self.sandbox, n)
        forks = []
        for sandbox in sandboxes:
            clone = copy.copy(self)
            clone.adopt_sandbox(sandbox)
            clone._np_random = copy.deepcopy(self._np_random)
            clone.command_count, clone.command_seconds = 0, 0.0
            forks.append(clone)
        return forks

    def adopt_sandbox(self, sandbox: Any) -> None:
        """Go on in ``sandbox``, a copy of this env's world (a fork, or a restore of a kept checkpoint),
        with this env's episode state: no lease on it yet, and a shell of its own on the next command."""
        self.sandbox = sandbox
        self._live = self._lease = None
        self._session = None

    def clean(self, text: str) -> str:
        """Make sandbox output a valid element of the observation space (printable, bounded length)."""
        text = "".join(c if c in TEXT_CHARSET else "?" for c in text)
        return text[: self.observation_space.max_length]
