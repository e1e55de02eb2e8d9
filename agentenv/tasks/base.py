"""`SandboxTask`: the base of every agent task, a gymnasium env whose world lives in an AgentENV sandbox.

A task subclasses it and writes three methods:

- ``setup(seed) -> str``: prepare the sandbox for a new episode (deterministically from ``seed``) and
  return the first observation;
- ``act(action) -> Outcome``: carry out the agent's action in the sandbox and say what it saw;
- ``reward(outcome) -> float``: the reward for that step (default: ``1.0`` when ``outcome.success``).

The base owns the sandbox: it is created on the first ``reset`` and **kept alive across episodes**
(each ``reset`` re-runs ``setup`` inside the running sandbox, which is far cheaper than a new
container), paused/resumed on request, forked with the episode state for identical GRPO group starts,
and closed by ``close()``. Commands go through a persistent shell session (see ``session.py``) unless
the task is built with ``session=False``. Observations and actions are gymnasium ``Text`` spaces.

Episode state that ``fork`` must carry lives in plain attributes holding immutable values (ints,
strings, tuples): a fork is a shallow copy of the env bound to the forked sandbox.
"""

from __future__ import annotations

import copy
import string
import time
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from gymnasium.spaces import Text

from agentenv.tasks.session import SessionError, SessionResult, ShellSession

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
    """Exit code and output of one command run in the sandbox (session or exec)."""

    exit_code: int
    output: str
    duration_s: float


class SandboxTask(gym.Env[str, str]):
    """Base class of sandboxed text tasks (see the module docstring).

    Keyword arguments (all come from the task's Hydra config ``env.kwargs``):
    ``max_turns``: the episode is truncated after this many actions;
    ``sandbox``: keyword arguments of ``Sandbox.create`` (``image``, ``memory``, ``cpus``, ``labels``,
    ``config`` as a `SandboxConfig` or the dict of every key, e.g. the Hydra ``sandbox`` group);
    ``session``: talk to the sandbox through a persistent shell (True) or one exec per command (False);
    ``max_observation_chars`` / ``max_action_chars``: sizes of the ``Text`` spaces;
    ``command_timeout_s``: per-command timeout.
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
    ) -> None:
        super().__init__()
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.sandbox_kwargs = dict(sandbox or {})
        self.use_session = session
        self.command_timeout_s = command_timeout_s
        self.observation_space = Text(min_length=0, max_length=max_observation_chars, charset=TEXT_CHARSET)
        self.action_space = Text(min_length=0, max_length=max_action_chars, charset=TEXT_CHARSET)
        self.sandbox = None
        self._session: ShellSession | None = None
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
        observation = self.clean(self.setup(seed))
        return observation, {"turn": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.episode_seed is None:
            raise RuntimeError("call reset() before step()")
        self.turn += 1
        outcome = self.act(str(action))
        reward = float(self.reward(outcome))
        terminated = bool(outcome.done or outcome.success)
        truncated = (not terminated) and self.turn >= self.max_turns
        info = {"turn": self.turn, "success": bool(outcome.success), **outcome.info}
        return self.clean(outcome.observation), reward, terminated, truncated, info

    def close(self) -> None:
        self._close_session()
        if self.sandbox is not None:
            try:
                self.sandbox.close()
            finally:
                self.sandbox = None

    # ----------------------------------------------------------------- sandbox plumbing
    def ensure_sandbox(self) -> None:
        """Create the sandbox (and install the task's programs) unless one is live already."""
        if self.sandbox is not None and self.sandbox.status == "paused":
            self.resume()
        if self.sandbox is None or self.sandbox.status in ("closed", "broken"):
            from agentenv import Sandbox, SandboxConfig

            self._close_session()
            kwargs = dict(self.sandbox_kwargs)
            if isinstance(kwargs.get("config"), dict):
                kwargs["config"] = SandboxConfig.from_dict(kwargs["config"])
            self.sandbox = Sandbox.create(**kwargs)
            self.install()

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run a shell command line in the sandbox (persistent session, or one exec)."""
        timeout = timeout or self.command_timeout_s
        started = time.perf_counter()
        if self.use_session:
            result = self._run_in_session(command, timeout)
        else:
            r = self.sandbox.exec(f"( {command} ) 2>&1", timeout=timeout)
            result = CommandResult(r.exit_code, r.stdout, r.duration_s)
        self.command_count += 1
        self.command_seconds += time.perf_counter() - started
        return result

    def _run_in_session(self, command: str, timeout: float) -> CommandResult:
        if self._session is None or self._session.closed:
            from agentenv.tasks.session import open_shell_session

            self._session = open_shell_session(self.sandbox)
        try:
            r: SessionResult = self._session.run(command, timeout=timeout)
        except SessionError:
            self._session = None
            raise
        return CommandResult(r.exit_code, r.output, r.duration_s)

    def _close_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def pause(self) -> float:
        """Checkpoint the sandbox to disk (no memory, no CPU while paused); returns seconds taken."""
        self._close_session()
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
        self._close_session()
        forks = []
        for sandbox in self.sandbox.fork(n):
            clone = copy.copy(self)
            clone.sandbox = sandbox
            clone._session = None
            clone._np_random = copy.deepcopy(self._np_random)
            clone.command_count, clone.command_seconds = 0, 0.0
            forks.append(clone)
        return forks

    def clean(self, text: str) -> str:
        """Make sandbox output a valid element of the observation space (printable, bounded length)."""
        text = "".join(c if c in TEXT_CHARSET else "?" for c in text)
        return text[: self.observation_space.max_length]
