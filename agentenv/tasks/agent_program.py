"""`AgentProgram`: a task whose episode runs an agent PROGRAM in the sandbox, scored by a verifier.

The program (``program.command``, its ``program.files`` written into each new sandbox) generates its
actions itself by calling an OpenAI-compatible API; the trainer only starts it. So an episode is one
gymnasium step: ``reset(seed)`` runs ``program.setup`` (``{seed}`` filled in; its output is the task text,
given to the program as ``$AGENT_TASK``), and ``step(action)`` runs the program with the environment
variables the action holds (a JSON object, e.g. the gateway's ``OPENAI_BASE_URL`` and the episode's
``OPENAI_API_KEY``: `rl.rollout.programs`), then the verifier on the final state. The reward is the
verifier's. A program that exits non-zero raises `ProgramFailed`; one that runs past ``program.timeout_s``
is killed and raises `agentenv.errors.ExecTimeout`: both are failures of the episode, not rewards.

Verifier (``verifier``): ``command`` (a shell line run in the sandbox; its last output line is the reward,
a number or a JSON object) or ``function`` (``module:function`` called as ``function(sandbox, seed,
**verifier.kwargs)``, returning the same); with ``fork: true`` it runs in a fork of the sandbox, closed
afterwards, so nothing it writes (hidden tests, say) stays where the agent played. A JSON verdict holds
``reward``, optionally ``success`` (default: reward > 0) and other numbers (reported as task metrics).
Files (``program.files``: sandbox path -> source): ``module:NAME`` (a string constant of a module),
``module`` (the module's own source file) or a path on this machine (anything with a ``/``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import numbers
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.errors import ConfigError
from agentenv.tasks.base import Outcome, SandboxTask

if TYPE_CHECKING:
    from agentenv.api import SandboxHandle

PROGRAM_KEYS = ("command", "files", "setup", "timeout_s", "cwd", "in_place_reset")
VERIFIER_KEYS = ("command", "function", "kwargs", "fork", "timeout_s")
OUTPUT_TAIL_CHARS = 600  # of a failed program's output, in its error


class ProgramFailed(RuntimeError):
    """The agent program exited with a non-zero status (a ``runtime_error`` failure of the episode)."""


@dataclass(frozen=True)
class Verdict:
    """What the verifier said of an episode's final state."""

    reward: float
    success: bool
    info: dict[str, float] = field(default_factory=dict)


def file_source(key: str, source: str) -> str:
    """The text of ``source`` (see the module docstring), or a `ConfigError` naming ``key``."""
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{key}: a file's source is a module, module:NAME or a path, got {source!r}")
    if "/" in source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ConfigError(f"{key}: no file {source!r} (relative paths start at {Path.cwd()})")
        return path.read_text()
    module_name, _, name = source.partition(":")
    if not name:
        spec = importlib.util.find_spec(module_name)
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            raise ConfigError(f"{key}: no module {module_name!r} with a source file")
        return Path(spec.origin).read_text()
    text = getattr(_module(key, module_name), name, None)
    if not isinstance(text, str):
        raise ConfigError(f"{key}: {module_name} has no string constant {name!r}")
    return text


def _module(key: str, name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {name!r}: {e}") from None


def verifier_function(key: str, target: str) -> Callable[..., Any]:
    """The function ``module:function`` names, or a `ConfigError` naming ``key``."""
    module_name, _, name = str(target).partition(":")
    if not module_name or not name:
        raise ConfigError(f"{key}: write the verifier as module:function, got {target!r}")
    fn = getattr(_module(key, module_name), name, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {module_name} has no function {name!r}")
    return fn


def verdict(value: Any, where: str) -> Verdict:
    """A verifier's answer (a number, a mapping, or the text of either) as a `Verdict`."""
    if isinstance(value, str):
        lines = value.strip().splitlines()
        try:
            value = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            raise ValueError(f"{where} printed {lines[-1][:200]!r} last, not a number or a JSON object") \
                from None
    if isinstance(value, Mapping):
        info = {str(k): float(v) for k, v in value.items()
                if k not in ("reward", "success") and isinstance(v, numbers.Real)}
        reward, success = value.get("reward"), value.get("success")
    else:
        info, reward, success = {}, value, None
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise ValueError(f"{where} gave no finite reward (a number, or a JSON object with 'reward'): "
                         f"{value!r}")
    return Verdict(float(reward), bool(reward > 0 if success is None else success), info)


def _checked(key: str, given: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(given, Mapping):
        raise ConfigError(f"{key}: expected a mapping with keys {', '.join(allowed)}, got {given!r}")
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown}; use {', '.join(allowed)}")
    return dict(given)


class AgentProgram(SandboxTask):
    """An agent program's episode in a sandbox (see the module docstring).

    ``program``: ``command`` (required), ``files`` (sandbox path -> source), ``setup`` (run at each reset,
    ``{seed}`` filled in), ``timeout_s`` (default 120), ``cwd`` (default /workspace), ``in_place_reset``
    (why ``setup`` alone restores the initial state, so that episodes reuse their sandbox; default: none,
    every episode gets a new sandbox, since a program may leave anything behind);
    ``verifier``: ``command`` or ``function``, ``kwargs`` (of the function), ``fork`` (default false),
    ``timeout_s`` (default 60).
    """

    runs_program = True  # episodes are played by the program (rl.rollout.programs), not turn by turn

    def __init__(self, program: Mapping | None = None, verifier: Mapping | None = None,
                 max_action_chars: int = 2048, **kwargs) -> None:
        kwargs.pop("max_turns", None)  # one step: the program plays the whole episode
        super().__init__(max_turns=1, max_action_chars=max_action_chars, **kwargs)
        prog = _checked("program", program if program is not None else {}, PROGRAM_KEYS)
        if not isinstance(prog.get("command"), str) or not prog["command"].strip():
            raise ConfigError("program.command: the command line that starts the agent program is required "
                              f"(a non-empty string), got {prog.get('command')!r}")
        self.command: str = prog["command"]
        self.setup_command: str | None = prog.get("setup")
        self.cwd: str = prog.get("cwd", "/workspace")
        reason = prog.get("in_place_reset")
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            raise ConfigError("program.in_place_reset: say why setup alone restores the initial state (a "
                              f"non-empty string), or leave it out; got {reason!r}")
        self.in_place_reset = reason
        self.timeout_s = float(prog.get("timeout_s", 120.0))
        if not self.timeout_s > 0:
            raise ConfigError(f"program.timeout_s: must be > 0, got {self.timeout_s}")
        files = prog.get("files") or {}
        if not isinstance(files, Mapping):
            raise ConfigError(f"program.files: expected a mapping of sandbox path -> source, got {files!r}")
        self.files = {str(path): file_source(f"program.files.{path}", src) for path, src in files.items()}
        check = _checked("verifier", verifier if verifier is not None else {}, VERIFIER_KEYS)
        kinds = [k for k in ("command", "function") if check.get(k)]
        if len(kinds) != 1:
            raise ConfigError(f"verifier: give exactly one of verifier.command or verifier.function, got "
                              f"{kinds or 'neither'}")
        self.verifier_command: str | None = check.get("command")
        self.verifier_fn = verifier_function("verifier.function", check["function"]) if "function" in kinds \
            else None
        self.verifier_kwargs = dict(check.get("kwargs") or {})
        self.verifier_fork = bool(check.get("fork", False))
        self.verifier_timeout_s = float(check.get("timeout_s", 60.0))
        self.task_text = ""
        self.verdict: Verdict | None = None  # of the episode's step

    # ----------------------------------------------------------------- SandboxTask hooks
    def install(self) -> None:
        for path, text in self.files.items():
            self.sandbox.write_file(path, text, mode=0o755 if text.startswith("#!") else 0o644)

    def setup(self, seed: int) -> str:
        self.task_text, self.verdict = "", None
        if self.setup_command:
            result = self.run(self.setup_command.replace("{seed}", str(seed % 2**31)))
            if result.exit_code != 0:
                raise RuntimeError(f"program.setup exited {result.exit_code}: {result.output[-300:]!r}")
            self.task_text = result.output.strip()
        return self.task_text

    def act(self, action: str) -> Outcome:
        variables = program_variables(action)
        variables["AGENT_TASK"] = self.task_text
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
        line = f"cd {shlex.quote(self.cwd)} && env {exports} sh -c {shlex.quote(self.command)}"
        result = self.run(line, timeout=self.timeout_s)  # past it: ExecTimeout (an exec_timeout failure)
        if result.exit_code != 0:
            raise ProgramFailed(f"the agent program exited {result.exit_code}; its output ends with "
                                f"{result.output[-OUTPUT_TAIL_CHARS:]!r}")
        self.verdict = self.verify()
        return Outcome(observation=result.output[-OUTPUT_TAIL_CHARS:], done=True,
                       success=self.verdict.success, info=dict(self.verdict.info))

    def reward(self, outcome: Outcome) -> float:
        """The verifier's reward of the episode (its one step)."""
        return self.verdict.reward if self.verdict is not None else 0.0

    # ----------------------------------------------------------------- the verifier
    def verify(self) -> Verdict:
        """The verifier's `Verdict` on the sandbox's current state (in a fork with ``verifier.fork``)."""
        self.hold_sandbox()  # leased until the episode ends (resumed first if its pool paused it)
        if not self.verifier_fork:
            sandbox = self._live or self.sandbox
            return self._verify_in(SessionExec(sandbox, self._session_in(sandbox)) if self.use_session
                                   else sandbox)
        fork = self.factory().fork(self._live or self.sandbox, 1)[0]
        try:
            return self._verify_in(fork)
        finally:
            fork.close()

    def _verify_in(self, sandbox: SandboxHandle) -> Verdict:
        seed = self.episode_seed or 0
        if self.verifier_fn is not None:
            return verdict(self.verifier_fn(sandbox, seed, **self.verifier_kwargs), "verifier.function")
        line = f"cd {shlex.quote(self.cwd)} && {self.verifier_command.replace('{seed}', str(seed % 2**31))}"
        result = sandbox.exec(["sh", "-c", line], timeout=self.verifier_timeout_s)
        if result.timed_out:
            from agentenv.errors import ExecTimeout

            raise ExecTimeout(f"verifier.command ran past {self.verifier_timeout_s} s", result)
        if result.exit_code != 0:
            output = (result.stdout + result.stderr)[-300:]
            raise RuntimeError(f"verifier.command exited {result.exit_code}: {output!r}")
        return verdict(result.stdout, "verifier.command")


class SessionExec:
    """``sandbox`` as a verifier sees it where the agent played: its plain ``exec`` calls run in the
    episode's shell ``session`` (the same result and limits; a few ms each, where a new exec costs a
    container runtime's exec, about 65 ms of CPU here), everything else is the sandbox's own."""

    def __init__(self, sandbox: SandboxHandle, session: Any) -> None:
        self._sandbox, self._session = sandbox, session

    def exec(self, cmd, timeout: float | None = None, stdin: bytes | str | None = None,
             env: Mapping[str, str] | None = None, workdir: str | None = None,
             raise_on_timeout: bool = False):
        if env is not None or workdir is not None or raise_on_timeout:
            return self._sandbox.exec(cmd, timeout=timeout, stdin=stdin, env=env, workdir=workdir,
                                      raise_on_timeout=raise_on_timeout)
        return self._session.run(cmd, timeout=timeout, stdin=stdin)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sandbox, name)


def program_variables(action: str) -> dict[str, str]:
    """The environment variables an `AgentProgram` action holds (a JSON object of strings)."""
    try:
        variables = json.loads(action)
    except json.JSONDecodeError:
        variables = None
    if not isinstance(variables, dict) or not all(
        isinstance(k, str) and k.isidentifier() and isinstance(v, str) for k, v in variables.items()
    ):
        raise ValueError("an AgentProgram action is the program's environment: a JSON object of variable "
                         f"names to strings (rl.rollout.programs writes it), got {action[:120]!r}")
    return variables
