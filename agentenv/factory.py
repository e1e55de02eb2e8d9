"""Where sandboxes come from, decided once by whoever makes an env: `sandbox_factory` gives this machine's
sandboxes (`LocalSandboxes`), a pool's (`PooledSandboxes`) or those of `agentenv serve` hosts
(`RemoteSandboxes`), all behind `agentenv.api.SandboxFactory`, so a task never asks which it holds."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentenv.api import SandboxFactory, SandboxHandle
from agentenv.config import SandboxConfig
from agentenv.errors import ConfigError

if TYPE_CHECKING:
    from agentenv.pool import SandboxPool
    from agentenv.remote import SandboxHosts

__all__ = ["LocalSandboxes", "PooledSandboxes", "RemoteSandboxes", "sandbox_factory"]

Setup = Callable[[SandboxHandle], None]


def _config(config: SandboxConfig | Mapping[str, Any] | None) -> SandboxConfig | None:
    return SandboxConfig.from_dict(dict(config)) if isinstance(config, Mapping) else config


@contextlib.contextmanager
def _resumed(handle: SandboxHandle, resume: Callable[[SandboxHandle], object] | None = None,
             ) -> Iterator[SandboxHandle]:
    """A lease on a sandbox that nothing else pauses: resumed (by `resume(handle)` when given) if it was
    paused."""
    if handle.status == "paused":
        (resume or type(handle).resume)(handle)
    yield handle


def _ready(handle: SandboxHandle, setup: Setup | None) -> SandboxHandle:
    """`handle` after `setup(handle)`; closed when the setup fails."""
    if setup is not None:
        try:
            setup(handle)
        except BaseException:
            with contextlib.suppress(Exception):
                handle.close()
            raise
    return handle


class _Unpooled:
    """What a factory without a pool does: a fork is the handle's own, and a lease only resumes a paused
    sandbox (nothing else pauses it)."""

    def fork(self, handle: SandboxHandle, n: int,
             labels: Mapping[str, str] | None = None) -> Sequence[SandboxHandle]:
        return handle.fork(n, labels=labels)

    def lease(self, handle: SandboxHandle) -> contextlib.AbstractContextManager[SandboxHandle]:
        return _resumed(handle)


class LocalSandboxes(_Unpooled):
    """Sandboxes of this machine's Docker engine (`agentenv.Sandbox`); no warm starts (`template` unused)."""

    def create(self, *, image: str | None = None, memory: str | None = None, cpus: float | None = None,
               config: SandboxConfig | None = None, labels: Mapping[str, str] | None = None,
               template: str | None = None, setup: Setup | None = None) -> SandboxHandle:
        from agentenv.sandbox import Sandbox

        sb = Sandbox.create(image=image, memory=memory, cpus=cpus, config=_config(config), labels=labels)
        return _ready(sb, setup)

    def __repr__(self) -> str:
        return "LocalSandboxes()"


class RemoteSandboxes(_Unpooled):
    """Sandboxes on `agentenv serve` hosts, each placed on the host with the most free memory
    (`agentenv.remote.SandboxHosts`, one per list of URLs per process; API key `$AGENTENV_API_KEY`).
    Their limits are the hosts' own config: `memory` and `cpus` are refused."""

    def __init__(self, urls: Sequence[str]) -> None:
        if isinstance(urls, str) or not urls:
            raise ConfigError(f"sandbox hosts must be a non-empty list of URLs, got {urls!r}")
        self.urls = [str(u) for u in urls]
        self._hosts: SandboxHosts | None = None

    @property
    def hosts(self) -> SandboxHosts:
        if self._hosts is None:
            from agentenv.remote import shared_hosts

            self._hosts = shared_hosts(self.urls)
        return self._hosts

    def create(self, *, image: str | None = None, memory: str | None = None, cpus: float | None = None,
               config: SandboxConfig | None = None, labels: Mapping[str, str] | None = None,
               template: str | None = None, setup: Setup | None = None) -> SandboxHandle:
        sb = self.hosts.create(image=image, memory=memory, cpus=cpus, config=_config(config), labels=labels)
        return _ready(sb, setup)

    def lease(self, handle: SandboxHandle) -> contextlib.AbstractContextManager[SandboxHandle]:
        """A paused sandbox resumes where there is room: moved to another host when its own lacks it
        (`SandboxHosts.resume`)."""
        return _resumed(handle, self.hosts.resume)

    def __repr__(self) -> str:
        return f"RemoteSandboxes({self.urls!r})"


class PooledSandboxes:
    """Members of a `SandboxPool`: with the pool's warm starts, a `template` (the ready state `setup` makes)
    is built once per template name and sandbox config and every new sandbox is a fork of it; a lease is
    the pool's (`pool.using`): the pool does not pause a held member and resumes one it had paused."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool = pool

    def create(self, *, image: str | None = None, memory: str | None = None, cpus: float | None = None,
               config: SandboxConfig | None = None, labels: Mapping[str, str] | None = None,
               template: str | None = None, setup: Setup | None = None) -> SandboxHandle:
        cfg = (_config(config) or self.pool.config or SandboxConfig.load()).replace(
            image=image, memory=memory, cpus=cpus)
        key = None
        if template is not None and self.pool.settings.warm_starts:
            digest = hashlib.sha1(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
            key = f"{template}@{digest[:12]}"
        return self.pool.create(template=key, setup=setup, labels=labels, config=cfg)

    def fork(self, handle: SandboxHandle, n: int,
             labels: Mapping[str, str] | None = None) -> Sequence[SandboxHandle]:
        return self.pool.fork(handle.id, n, labels=labels)

    def lease(self, handle: SandboxHandle) -> contextlib.AbstractContextManager[SandboxHandle]:
        return self.pool.using(handle.id)

    def __repr__(self) -> str:
        return f"PooledSandboxes({self.pool.name!r})"


def sandbox_factory(sandbox: Mapping[str, Any] | None = None,
                    pool: SandboxPool | None = None) -> SandboxFactory:
    """The factory for a task's `sandbox` keyword arguments: the hosts in ``sandbox["hosts"]`` when set,
    else `pool`'s members when given, else this machine's sandboxes. Hosts and a pool do not combine: a
    pool's budget is this machine's memory and its pauses are local checkpoints."""
    hosts = (sandbox or {}).get("hosts")
    if hosts and pool is not None:
        raise ConfigError("sandbox.hosts (remote sandboxes) cannot be combined with a local SandboxPool: the "
                          "pool's budget and pauses are this machine's; drop one of them")
    if hosts:
        return RemoteSandboxes(list(hosts))
    if pool is not None:
        return PooledSandboxes(pool)
    return LocalSandboxes()
