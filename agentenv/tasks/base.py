"""`SandboxTask`: the base of every agent task, a gymnasium env whose world lives in an AgentENV sandbox.

A task subclasses it and writes ``setup(seed) -> str`` (prepare the sandbox for an episode, return the
first observation), ``act(action) -> Outcome`` and optionally ``reward(outcome)`` and ``install()`` (put
the task's programs in place, once per sandbox). The base owns the sandbox, a `SandboxHandle` taken from
the env's `SandboxFactory` (``sandboxes=``; default: `agentenv.factory.sandbox_factory` of the ``sandbox``
kwargs): created on the first ``reset``, leased for each ``reset`` and ``step`` (between them it runs
unleased, and its pool's residency may pause it), paused, resumed, forked with the episode state (GRPO
groups) and closed by ``close()``. Commands go through the sandbox's
persistent shell session unless ``session=False``. See docs/tasks.md.

Episode isolation: an episode sees the task's initial state and nothing an earlier episode left (files,
background processes, the shell session's environment). By default every ``reset`` after an episode was
played starts in a new sandbox from the factory: with a pool's warm starts a fork of the task's template
checkpoint (the state ``install()`` made), else a fresh sandbox and ``install()``; the old one is closed.
A task whose ``setup`` alone restores the initial state, because nothing an episode can do leaves
anything behind, says why in ``in_place_reset`` and keeps its sandbox across episodes (cheaper).
"""

from __future__ import annotations

import copy
import logging
import shlex
import string
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import gymnasium as gym
from gymnasium.spaces import Text

if TYPE_CHECKING:
    from agentenv.api import SandboxFactory, SandboxHandle, ShellSession
    from agentenv.config import SandboxConfig

SANDBOX_OPTIONS = ("config", "image", "memory", "cpus", "labels", "hosts")
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

    Keyword arguments (all but ``sandboxes`` come from the task's Hydra config ``env.kwargs``):
    ``max_turns``: the episode is truncated after this many actions;
    ``sandbox``: keyword arguments of ``Sandbox.create`` (``image``, ``memory``, ``cpus``, ``labels``,
    ``config`` as a `SandboxConfig` or the dict of every key, e.g. the Hydra ``sandbox`` group), plus
    ``hosts``: a list of ``agentenv serve`` URLs (read only by the default factory);
    ``session``: talk to the sandbox through a persistent shell (True) or one exec per command (False);
    ``max_observation_chars`` / ``max_action_chars``: sizes of the ``Text`` spaces;
    ``command_timeout_s``: per-command timeout;
    ``sandboxes``: the `SandboxFactory` to take the sandbox from (passed by whoever makes the env, e.g.
    the trainer with its pool; default: `sandbox_factory(sandbox)`).
    """

    metadata = {"render_modes": []}
    # Why ``setup`` alone restores the initial state in the sandbox an earlier episode played in (the
    # sandbox is then reused); None: every episode after the first gets a new sandbox (module docstring)
    in_place_reset: str | None = None

    def __init__(
        self,
        max_turns: int = 8,
        sandbox: dict | None = None,
        session: bool = True,
        max_observation_chars: int = 2048,
        max_action_chars: int = 256,
        command_timeout_s: float = 30.0,
        sandboxes: SandboxFactory | None = None,
    ) -> None:
        super().__init__()
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        unknown = sorted(set(sandbox or {}) - set(SANDBOX_OPTIONS))
        if unknown:
            raise ValueError(f"unknown sandbox option(s) {unknown}; use {', '.join(SANDBOX_OPTIONS)}")
        self.max_turns = max_turns
        self.sandbox_kwargs = dict(sandbox or {})
        self.use_session = session
        self.command_timeout_s = command_timeout_s
        self.observation_space = Text(min_length=0, max_length=max_observation_chars, charset=TEXT_CHARSET)
        self.action_space = Text(min_length=0, max_length=max_action_chars, charset=TEXT_CHARSET)
        self.sandboxes = sandboxes
        self.sandbox: SandboxHandle | None = None
        self._live: SandboxHandle | None = None  # the handle the open lease gives (see `hold_sandbox`)
        self._lease: AbstractContextManager[SandboxHandle] | None = None
        self._session: ShellSession | None = None
        self._session_of = ""  # the id of the sandbox `_session` runs in
        self.turn = 0
        self.episode_seed: int | None = None
        self.played = False  # whether an episode was reset in the current sandbox (see `reset`)
        self.command_count = 0
        self.command_seconds = 0.0
        self.sandboxes_created = 0  # sandboxes this env took from its factory (`ensure_sandbox`)

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
        if self.played and self.in_place_reset is None:
            self.discard_sandbox()  # an earlier episode played in it: start from the template again
        self.ensure_sandbox()
        self.turn = 0
        self.episode_seed = seed
        self.played = True
        with self.leased():
            observation = self.clean(self.setup(seed))
        return observation, {"turn": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.episode_seed is None:
            raise RuntimeError("call reset() before step()")
        self.turn += 1
        with self.leased():
            outcome = self.act(str(action))
            reward = float(self.reward(outcome))
        terminated = bool(outcome.done or outcome.success)
        truncated = (not terminated) and self.turn >= self.max_turns
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
    def factory(self) -> SandboxFactory:
        """Where this env's sandboxes come from (made from the ``sandbox`` kwargs unless given)."""
        if self.sandboxes is None:
            from agentenv.factory import sandbox_factory

            self.sandboxes = sandbox_factory(self.sandbox_kwargs)
        return self.sandboxes

    def ensure_sandbox(self) -> None:
        """Create the sandbox (its ready state: `install()`) unless a live one is there; a closed or broken
        one is closed and replaced."""
        if self.sandbox is not None and self.sandbox.status in ("closed", "broken"):
            self.release_sandbox()
            self._close_session()
            old, self.sandbox = self.sandbox, None
            try:
                old.close()
            except Exception:  # e.g. its host is gone: nothing left to free here
                pass
        if self.sandbox is None:
            self._close_session()
            options = {k: v for k, v in self.sandbox_kwargs.items() if k != "hosts"}
            task = f"{type(self).__module__}.{type(self).__qualname__}"
            self.sandbox = self.factory().create(**options, template=task, setup=self._install_into)
            self.sandboxes_created += 1

    def discard_sandbox(self) -> None:
        """Close this env's sandbox (the next `ensure_sandbox` makes a new one in the template state); a
        sandbox already gone is not an error: there is nothing left to free."""
        self.release_sandbox()
        self._close_session()
        old, self.sandbox, self.played = self.sandbox, None, False
        if old is not None:
            try:
                old.close()
            except Exception as e:  # e.g. its container or host is gone already: reported, not raised
                logging.getLogger(__name__).warning("closing the played sandbox %s before a new episode "
                                                    "failed: %s", getattr(old, "id", "?"), e)

    def sandbox_config(self) -> SandboxConfig:
        """The `SandboxConfig` of this task's sandboxes (``sandbox`` kwargs: config, image, memory, cpus)."""
        from agentenv import SandboxConfig

        kwargs = self.sandbox_kwargs
        config = kwargs.get("config")
        if isinstance(config, dict):
            config = SandboxConfig.from_dict(config)
        return (config or SandboxConfig.load()).replace(
            image=kwargs.get("image"), memory=kwargs.get("memory"), cpus=kwargs.get("cpus")
        )

    def _install_into(self, sandbox: SandboxHandle) -> None:
        """`install()` into a new sandbox (a pool's template, or this env's own); its session is closed
        afterwards (a template is not this env's)."""
        previous = self.sandbox, self._live
        self.sandbox = self._live = sandbox
        try:
            self.install()
        finally:
            self._close_session()
            self.sandbox, self._live = previous

    @contextmanager
    def leased(self) -> Iterator[None]:
        """The sandbox leased for one call (a reset, a step, a command outside them), released at its end;
        a lease held already (`hold_sandbox`, an install) stays as it is."""
        if self._live is not None or self._lease is not None or self.sandbox is None:
            yield
            return
        self.hold_sandbox()
        try:
            yield
        finally:
            self.release_sandbox()

    def hold_sandbox(self) -> None:
        """Lease the sandbox until `release_sandbox()` (no-op when held): resumed if it was paused, and not
        paused by its pool meanwhile. `reset` and `step` hold one for their call only (`leased`)."""
        if self._live is not None or self.sandbox is None:
            return  # held already (or installing: `_install_into` set `_live`)
        lease = self.factory().lease(self.sandbox)
        self._live = lease.__enter__()
        self._lease = lease

    def release_sandbox(self) -> None:
        """End the lease: idle from now on, the sandbox may be paused by its pool (no-op if not held)."""
        if self._lease is None:
            return
        lease, self._lease, self._live = self._lease, None, None
        lease.__exit__(None, None, None)

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run a shell command line in the sandbox, stderr merged into its output (the session's shell, or
        one exec). At ``timeout`` (default ``command_timeout_s``), the platform's limit, its whole process
        group is killed and `agentenv.errors.ExecTimeout` (carrying the result) is raised: the episode
        fails as an infrastructure failure (``rl.failures``). A limit that is part of the game goes
        inside the command (``timeout 5 sh -c ...``): its exit code 124 is an ordinary result."""
        timeout = timeout or self.command_timeout_s
        started = time.perf_counter()
        line = f"( {command} ) 2>&1"
        with self.leased():
            sandbox = self._live or self.sandbox
            r = self._session_in(sandbox).run(line, timeout=timeout) if self.use_session else \
                sandbox.exec(line, timeout=timeout)
        self.command_count += 1
        self.command_seconds += time.perf_counter() - started
        result = CommandResult(r.exit_code, r.stdout, r.duration_s, r.timed_out, r.truncated)
        if r.timed_out:
            from agentenv.errors import ExecTimeout

            raise ExecTimeout(
                f"the platform's command timeout ({timeout} s) killed {command[:120]!r} "
                f"(exit {r.exit_code}); "
                "raise the task's command_timeout_s if the command is meant to run that long",
                result,
            )
        return result

    def run_agent_command(self, command: str, cwd: str, limit_s: int, max_chars: int) -> str:
        """The observation of an agent's command line: run in ``cwd`` under the game's own ``limit_s``
        (``timeout``: exit 124 is an ordinary result), its output cut to ``max_chars``. A line no shell
        can take (a NUL byte: argv strings end at one) is the agent's mistake, told back as its
        observation, never an infrastructure failure of the episode."""
        if "\0" in command:
            return "sh: cannot run a command that contains a NUL byte"
        output = self.run(f"cd {cwd} && timeout {limit_s} sh -c {shlex.quote(command)}").output
        return output[:max_chars] or "(no output)"

    def _session_in(self, sandbox: SandboxHandle) -> ShellSession:
        """This env's session in ``sandbox`` (a new one when the env moved to another sandbox)."""
        if self._session is None or self._session.closed or self._session_of != sandbox.id:
            self._close_session()
            self._session = sandbox.session()
            self._session_of = sandbox.id
        return self._session

    def _close_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def pause(self) -> float:
        """Release the sandbox and checkpoint it to disk (no memory, no CPU while paused); returns seconds
        taken."""
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
        sandboxes = self.factory().fork(self.sandbox, n)  # a paused sandbox is forked as it is
        forks = []
        for sandbox in sandboxes:
            clone = copy.copy(self)
            clone.adopt_sandbox(sandbox)
            clone._np_random = copy.deepcopy(self._np_random)
            clone.command_count, clone.command_seconds, clone.sandboxes_created = 0, 0.0, 0
            forks.append(clone)
        return forks

    def adopt_sandbox(self, sandbox: SandboxHandle) -> None:
        """Go on in ``sandbox``, a copy of this env's world (a fork, or a restore of a kept checkpoint),
        with this env's episode state: no lease on it yet, and a shell of its own on the next command."""
        self.sandbox = sandbox
        self._live = self._lease = None
        self._session = None
        self._session_of = ""

    def clean(self, text: str) -> str:
        """Make sandbox output a valid element of the observation space (printable, bounded length)."""
        text = "".join(c if c in TEXT_CHARSET else "?" for c in text)
        return text[: self.observation_space.max_length]
