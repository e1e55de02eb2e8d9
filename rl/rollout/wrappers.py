"""Task envs as the runner steps them: made by gymnasium (env checker on), wrapped by ``env.wrappers``.

``gymnasium.make`` builds the task with gymnasium's own wrappers (the passive env checker, order
enforcing), then every wrapper named in ``env.wrappers`` is applied, innermost first. The runner steps
that outermost env, so a wrapper that reshapes rewards or observations changes what the policy sees
and what it is trained on. Sandbox operations (fork, release) go to the task underneath
(``env.unwrapped``); `fork_env` gives every fork its own copy of the wrapper chain, in the state the
original's wrappers were in.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import gymnasium

from agentenv.api import SandboxFactory
from agentenv.errors import ConfigError
from agentenv.tasks import SandboxTask

WrapperSpec = tuple[type[gymnasium.Wrapper], dict[str, Any]]


def wrapper_spec(entry: Any, key: str) -> WrapperSpec:
    """``"module:Class"`` or ``{cls: "module:Class", kwargs: {...}}`` -> (class, kwargs)."""
    from rl.config.imports import import_object

    if isinstance(entry, str):
        target, kwargs = entry, {}
    elif isinstance(entry, Mapping) and "cls" in entry and set(entry) <= {"cls", "kwargs"}:
        target, kwargs = entry["cls"], dict(entry.get("kwargs") or {})
    else:
        raise ConfigError(
            f"{key}: expected 'module:Class' or {{cls: 'module:Class', kwargs: {{...}}}}, got {entry!r}"
        )
    cls = import_object(str(target), key)
    if not (isinstance(cls, type) and issubclass(cls, gymnasium.Wrapper)):
        raise ConfigError(f"{key}: {target!r} is not a gymnasium.Wrapper subclass")
    return cls, kwargs


def wrapper_specs(entries: list[Any] | None) -> list[WrapperSpec]:
    """Every ``env.wrappers`` entry resolved (see `wrapper_spec`)."""
    return [wrapper_spec(entry, f"env.wrappers[{i}]") for i, entry in enumerate(entries or [])]


def make_env(
    env_id: str, kwargs: dict[str, Any], wrappers: list[WrapperSpec], sandboxes: SandboxFactory | None = None
) -> gymnasium.Env:
    """The task ``env_id`` with gymnasium's env checker and the user's wrappers; its sandboxes from
    ``sandboxes`` (default: the task's own, `agentenv.factory.sandbox_factory` of its ``sandbox`` kwargs)."""
    extra = {"sandboxes": sandboxes} if sandboxes is not None else {}
    env = gymnasium.make(env_id, disable_env_checker=False, **kwargs, **extra)
    for cls, wrapper_kwargs in wrappers:
        env = cls(env, **wrapper_kwargs)
    if not isinstance(env.unwrapped, SandboxTask):
        env.close()
        raise TypeError(f"{env_id} is not a SandboxTask env (got {type(env.unwrapped).__name__})")
    return env


def task(env: gymnasium.Env) -> SandboxTask:
    """The sandboxed task under the wrappers (its sandbox operations are not wrapped)."""
    return env.unwrapped  # type: ignore[return-value]


def fork_env(env: gymnasium.Env, n: int) -> list[gymnasium.Env]:
    """``n`` forks of a reset env, each inside a copy of ``env``'s wrapper chain (state included)."""
    return [_rewrap(env, fork) for fork in task(env).fork(n)]


def _rewrap(env: gymnasium.Env, fork: SandboxTask) -> gymnasium.Env:
    if env is env.unwrapped:
        return fork
    clone = copy.copy(env)
    for name, value in vars(env).items():  # each wrapper's own state, copied (a counter per episode)
        if name not in ("env", "_cached_spec"):
            clone.__dict__[name] = copy.deepcopy(value)
    clone.__dict__["_cached_spec"] = None
    clone.env = _rewrap(env.env, fork)
    return clone
