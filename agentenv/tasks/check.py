"""`agentenv tasks check`: gymnasium's env checker on a task, in real sandboxes, leaving none behind.

`check_task` makes the env as ``gymnasium.make`` does (a ``module:ns/Name-v0`` id imports its module
first), checks that the task passes its options on to `SandboxTask` (a task that drops ``**kwargs``
would never get the trainer's sandboxes), runs ``gymnasium.utils.env_checker.check_env`` on it (resets
with and without seeds, seeded determinism, steps with sampled actions) and plays one more reset and
step, then closes the env: every sandbox it made is closed. Its sandboxes carry this process's owner
label (`agentenv.owner`), so that a check killed halfway leaves nothing ``agentenv gc`` does not remove.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import gymnasium
import yaml

from agentenv.errors import AgentEnvError


class TaskCheckFailed(AgentEnvError):
    """The task failed the check (the message holds the frames of the task's own files)."""


def config_target(path: str | Path) -> tuple[str, dict[str, Any], str | None]:
    """``(env id, kwargs, an action)`` of a task config file (``conf/env/<name>.yaml``: its ``id``, its
    ``kwargs`` and the first character of its ``action_vocabulary``, None when it has none)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise TaskCheckFailed(f"cannot read the task config {path}: {exc}") from None
    if not isinstance(data, dict) or "id" not in data:
        raise TaskCheckFailed(f"{path} has no `id:`; a task config names its env id (module:ns/Name-v0)")
    vocabulary = data.get("action_vocabulary")
    return str(data["id"]), dict(data.get("kwargs") or {}), str(vocabulary)[:1] if vocabulary else None


def _import_module(env_id: str) -> None:
    if ":" in env_id:
        module = env_id.split(":", 1)[0]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TaskCheckFailed(f"cannot import the task's module {module!r} (run from the folder that "
                                  f"holds it, or put it on PYTHONPATH): {exc}") from None


def check_task(env_id: str, kwargs: dict[str, Any] | None = None, seed: int = 0,
               action: str | None = None) -> list[str]:
    """Check the task ``env_id`` made with ``kwargs`` (see the module docstring); returns what was done,
    a line each. Raises `TaskCheckFailed` naming the step and the task's lines."""
    from gymnasium.utils.env_checker import check_env

    from agentenv.factory import LocalSandboxes
    from agentenv.owner import owner_labels
    from agentenv.tracebacks import describe

    _import_module(env_id)
    kwargs = dict(kwargs or {})
    sandbox = dict(kwargs.pop("sandbox", None) or {})
    sandbox["labels"] = {**(sandbox.get("labels") or {}), **owner_labels()}
    factory = LocalSandboxes()
    done: list[str] = []
    env = None
    step = f"gymnasium.make({env_id!r})"
    try:
        env = gymnasium.make(env_id, sandbox=sandbox, sandboxes=factory, **kwargs)
        task = env.unwrapped
        if getattr(task, "sandboxes", None) is not factory:
            raise TaskCheckFailed(
                f"{type(task).__name__}.__init__ does not pass its **kwargs on to super().__init__: the "
                "options every task takes (sandbox, session, sandboxes, ...) never reach SandboxTask; end "
                "its signature with **kwargs and call super().__init__(max_turns=max_turns, **kwargs)")
        reason = getattr(task, "in_place_reset", None)
        if reason is not None and not (isinstance(reason, str) and reason.strip()):
            raise TaskCheckFailed(f"{type(task).__name__}.in_place_reset must be None or a sentence saying "
                                  f"why setup alone restores the initial state, got {reason!r}")
        step = "gymnasium.utils.env_checker.check_env"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(task, skip_render_check=True)
        done.append(f"{env_id}: gymnasium's env checker passed"
                    + "".join(f"\n  warning: {w.message}" for w in caught))
        step = f"reset(seed={seed})"
        observation, _ = env.reset(seed=seed)
        done.append(f"{step} -> {observation[:120]!r}")
        probe = env.action_space.sample()[:16] if action is None else action
        step = f"step({probe!r})"
        observation, reward, terminated, truncated, info = env.step(probe)
        done.append(f"{step} -> {observation[:120]!r}, reward {reward}, terminated {terminated}, "
                    f"truncated {truncated}, info {info}")
        step = "close()"
        env.close()
        done.append(f"closed: {task.sandboxes_created} sandboxes made, none left running")
        env = None
    except TaskCheckFailed:
        raise
    except Exception as exc:
        raise TaskCheckFailed(f"{env_id}: {step} raised {describe(exc, fallback=3)}") from None
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:  # the first error is the one to report
                pass
    return done
