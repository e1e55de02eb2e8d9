"""The sandbox interface every kind of sandbox implements, and the factory tasks take their sandboxes from.

`SandboxHandle`: one sandbox, whether local (`agentenv.Sandbox`), a pool member
(`agentenv.pool.PooledSandbox`) or on an `agentenv serve` host (`agentenv.remote.RemoteSandbox`);
`ShellSession`: its persistent shell; `SandboxFactory`: where a task's sandboxes come from
(`agentenv.factory`). The same call gives the same result and the same error type on every kind; the
argument checks are in `agentenv.checks`, the error types and their wire table in `agentenv.errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from agentenv.checks import MAX_FORKS
from agentenv.config import SandboxConfig
from agentenv.results import ExecResult, SandboxStats

__all__ = ["MAX_FORKS", "SandboxFactory", "SandboxHandle", "ShellSession"]


@runtime_checkable
class ShellSession(Protocol):
    """A persistent shell in a running sandbox: `run` has `exec`'s result and guarantees. `reopened` says
    whether the last `run` had to start a new shell (after a pause, a fork, a host-side kill)."""

    reopened: bool

    @property
    def closed(self) -> bool: ...

    def run(self, cmd: str | Sequence[str], timeout: float | None = None,
            stdin: bytes | str | None = None) -> ExecResult: ...

    def close(self) -> None: ...

    def __enter__(self) -> ShellSession: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class SandboxHandle(Protocol):
    """One sandbox (see docs/agentenv.md, "API"). `status` is read anew on every access: 'running',
    'paused', 'closed' or 'broken'."""

    @property
    def id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def labels(self) -> dict[str, str]: ...

    @property
    def user(self) -> str: ...

    @property
    def parent_id(self) -> str | None: ...

    @property
    def config(self) -> SandboxConfig: ...

    def exec(self, cmd: str | Sequence[str], timeout: float | None = None, stdin: bytes | str | None = None,
             env: Mapping[str, str] | None = None, workdir: str | None = None,
             raise_on_timeout: bool = False) -> ExecResult: ...

    def session(self) -> ShellSession: ...

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    def read_file(self, path: str) -> bytes: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def fork(self, n: int, labels: Mapping[str, str] | None = None) -> Sequence[SandboxHandle]: ...

    def close(self) -> None: ...

    def stats(self) -> SandboxStats: ...

    def describe(self) -> dict[str, Any]: ...


@runtime_checkable
class SandboxFactory(Protocol):
    """Where a task's sandboxes come from: this machine, a `SandboxPool`, or sandbox hosts
    (`agentenv.factory.sandbox_factory` picks one). A task calls only these, whichever it was given."""

    def create(self, *, image: str | None = None, memory: str | None = None, cpus: float | None = None,
               config: SandboxConfig | None = None, labels: Mapping[str, str] | None = None,
               template: str | None = None,
               setup: Callable[[SandboxHandle], None] | None = None) -> SandboxHandle:
        """A new running sandbox, brought to its ready state by `setup(sandbox)`. `template` names that
        ready state (e.g. the task class): a factory with warm starts builds it once and forks it."""
        ...

    def fork(self, handle: SandboxHandle, n: int,
             labels: Mapping[str, str] | None = None) -> Sequence[SandboxHandle]:
        """`n` new running sandboxes with `handle`'s memory and files."""
        ...

    def lease(self, handle: SandboxHandle) -> AbstractContextManager[SandboxHandle]:
        """Hold `handle` for a stretch of use (an episode): it is resumed if paused, nothing pauses it
        meanwhile, and the block gets the handle to run commands on."""
        ...
