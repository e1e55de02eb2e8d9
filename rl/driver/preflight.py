"""Before Ray starts: what the config asks of this host, the task's options against its signature, and
one env of it made, reset and stepped.

A mistake in a task's options or code would otherwise surface only inside a Ray worker, tens of seconds
later and under platform frames: `check_task_options` names the nearest parameters, `try_task` raises
`TaskFailed` with the frames of the task's own files.

Design: docs/design/training.md#rl-preflight.
"""

from __future__ import annotations

import inspect
from typing import Any

import gymnasium

from agentenv.errors import ConfigError
from agentenv.tracebacks import describe
from rl.config import RunConfig
from rl.config.names import did_you_mean

# what the runner itself passes to every task (rl.rollout.runner.task_kwargs, rl.rollout.wrappers.make_env)
PLATFORM_KWARGS = ("sandbox", "sandboxes")


def check_runtime(run: RunConfig) -> None:
    """The config's demands on the code and the host, which its own checks (`rl.config.checks`, pure)
    leave here: the wrappers import, vLLM imports, ``trainer.device=cuda`` has its GPUs. A one-line
    `ConfigError` naming the key."""
    if run.env.wrappers:
        from rl.rollout.wrappers import wrapper_spec

        for i, entry in enumerate(run.env.wrappers):
            wrapper_spec(entry, f"env.wrappers[{i}]")
    if run.rollout.engine == "vllm":
        from rl.rollout.engines import EngineUnavailable, check_vllm_available

        try:
            check_vllm_available()
        except EngineUnavailable as exc:
            raise ConfigError(f"rollout.engine: {exc}") from None
    if run.trainer.device == "cuda":  # torch is imported for this setting only (`auto` resolves later)
        from rl.device import check_device

        check_device(run)


class TaskFailed(RuntimeError):
    """The task raised while being made, reset, stepped or closed in the pre-flight check."""


def _spec(env_id: str) -> gymnasium.envs.registration.EnvSpec:
    """The registered spec of ``env_id`` (``module:`` ids: the config check imported the module)."""
    bare = env_id.split(":", 1)[1] if ":" in env_id else env_id
    return gymnasium.spec(bare)


def _entry_point(spec: gymnasium.envs.registration.EnvSpec) -> Any:
    entry = spec.entry_point
    return gymnasium.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry


def accepted_options(creator: Any) -> tuple[list[str], bool]:
    """``(names, open)``: the keyword parameters ``creator`` (a task class or a factory function) takes,
    following ``**kwargs`` up the class's ``__init__`` chain; ``open`` when some ``**kwargs`` reach
    code that takes any name (then no name can be refused)."""
    names: list[str] = []
    if not isinstance(creator, type):
        params = inspect.signature(creator).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return names, any(p.kind is p.VAR_KEYWORD for p in params)
    for cls in creator.__mro__:
        if "__init__" not in vars(cls):
            continue
        if cls in (gymnasium.Env, object) or cls.__module__.startswith("gymnasium"):
            return names, False
        params = list(inspect.signature(vars(cls)["__init__"]).parameters.values())[1:]  # self
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names, False
    return names, True


def check_task_options(run: RunConfig) -> None:
    """Every key of ``env.kwargs`` (and of the id's registered kwargs) is an option of the task."""
    spec = _spec(run.env.id)
    creator = _entry_point(spec)
    names, open_ended = accepted_options(creator)
    what = getattr(creator, "__name__", str(creator))
    if open_ended:
        return
    if "sandboxes" not in names:
        raise ConfigError(
            f"env.id: {run.env.id}: {what}.__init__ takes no **kwargs, but the trainer passes every task the "
            "options of SandboxTask (sandbox=, sandboxes=); end its signature with **kwargs and call "
            "super().__init__(max_turns=max_turns, **kwargs)"
        )
    options = [n for n in names if n not in PLATFORM_KWARGS]
    listed = ", ".join(sorted(dict.fromkeys(options)))
    for key in [*(spec.kwargs or {}), *run.env.kwargs]:
        if key not in names:
            exc = ConfigError(f"env.kwargs.{key}: {what} takes no option {key!r}")
            exc.hint = f"{did_you_mean('env.kwargs', key, options)} (its options: {listed})"
            raise exc


def probe_action(run: RunConfig) -> str:
    """An action the policy could type: the first character of ``env.action_vocabulary`` (or ``0``)."""
    return (run.env.action_vocabulary or "0")[:1]


def try_task(run: RunConfig) -> list[str]:
    """Make, reset, step and close one env of the task here (see the module docstring); returns what it
    did, one line per call. Raises `TaskFailed`."""
    from agentenv.factory import sandbox_factory
    from agentenv.owner import owner_labels
    from rl.rollout.runner import task_kwargs
    from rl.rollout.wrappers import make_env, task, wrapper_specs
    from rl.seeds import group_seeds

    kwargs = task_kwargs(run.env, run.sandbox)
    sandbox = dict(kwargs.get("sandbox") or {})
    sandbox["labels"] = {**(sandbox.get("labels") or {}), **owner_labels()}  # gc closes it if we die
    kwargs["sandbox"] = sandbox
    factory = sandbox_factory(sandbox)
    done: list[str] = []
    env = None
    step = f"gymnasium.make({run.env.id!r})"
    try:
        env = make_env(run.env.id, kwargs, wrapper_specs(run.env.wrappers), factory)
        if task(env).sandboxes is not factory:
            raise TaskFailed(
                f"{type(task(env)).__name__}.__init__ does not pass its **kwargs on to super().__init__: "
                "the options every task takes (sandbox, session, sandboxes, ...) never reach SandboxTask, so "
                "its sandboxes would not come from the trainer's pool; end __init__'s signature with "
                "**kwargs and call super().__init__(max_turns=max_turns, **kwargs)"
            )
        seed = group_seeds(run.seed, 0, 1)[0]
        step = f"env.reset(seed={seed})"
        observation, _ = env.reset(seed=seed)
        done.append(f"{step} -> {observation[:80]!r}")
        program = getattr(task(env), "runs_program", False)  # an agent program acts: check its verifier
        if program:
            step = "the verifier on the reset state"
            done.append(f"{step} -> {task(env).verify()}")
        for action in () if program else (probe_action(run), ""):
            step = f"env.step({action!r})"
            observation, reward, terminated, truncated, _ = env.step(action)
            done.append(f"{step} -> {observation[:80]!r}, reward {reward}")
            if terminated or truncated:
                break
        step = "env.close()"
        env.close()
        env = None
    except TaskFailed:
        raise
    except Exception as exc:
        raise TaskFailed(f"{step} raised {describe(exc, fallback=3)}") from None
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:  # the first error is the one to report
                pass
    return done
