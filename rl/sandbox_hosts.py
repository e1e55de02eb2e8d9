"""``sandbox.hosts``: the rollout sandboxes on `agentenv serve` hosts instead of this machine's Docker.

The ``sandbox`` group is AgentENV's `SandboxConfig` (conf/sandbox/default.yaml) plus one run setting,
``hosts`` (set in conf/config.yaml, like ``model.init_from``): a list of server URLs. Empty or null (the
default) keeps every sandbox local. Set, each task's sandbox is created through ``agentenv.remote`` on
the host with the most free memory (``SandboxTask(sandbox={"hosts": [...]})``), and the task talks to a
`RemoteSandbox` with the same methods as a local `Sandbox`: the step path does not change. A sandbox
found paused when its episode leases it resumes where there is memory for it: moved to another host when
its own lacks room (`agentenv.factory.RemoteSandboxes.lease`, `agentenv.remote.SandboxHosts.resume`).

Remote sandboxes take their limits (memory, CPUs, ...) from their host's own sandbox config; the run's
``sandbox`` keys other than ``image`` do not apply to them. The hosts' API key is ``$AGENTENV_API_KEY``
in the driver's environment; the driver hands it to each rollout worker as a constructor argument
(`worker_environment`), not through Ray's ``runtime_env`` (whose agent writes it to its log) nor the
config (which is saved with the run).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from agentenv.errors import ConfigError
from agentenv.paths import API_KEY_ENV

HOSTS_KEY = "hosts"


def split_hosts(sandbox: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The ``sandbox`` group as (its `SandboxConfig` keys, its host URLs; [] = local sandboxes)."""
    config = dict(sandbox or {})
    hosts = config.pop(HOSTS_KEY, None)
    return config, list(hosts or [])


def check_hosts(hosts: Any) -> list[str]:
    """``sandbox.hosts`` is null or a list of distinct ``http(s)://host[:port]`` URLs; with hosts, the
    API key is in this process's environment. Raises a one-line `ConfigError` naming the key."""
    if hosts is None:
        return []
    if isinstance(hosts, str) or not isinstance(hosts, list | tuple):
        raise ConfigError(f"sandbox.hosts: expected a list of agentenv serve URLs, got {hosts!r}")
    for i, url in enumerate(hosts):
        parts = urlsplit(url) if isinstance(url, str) else None
        try:
            port_ok = parts is not None and (parts.port is None or parts.port > 0)
        except ValueError:
            port_ok = False
        if not parts or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
                or parts.path.strip("/") or parts.query:
            raise ConfigError(f"sandbox.hosts[{i}]: {url!r} is not the URL of an agentenv serve host "
                              "(http://HOST:PORT or https://HOST:PORT)")
    if len({u.rstrip("/") for u in hosts}) != len(hosts):
        raise ConfigError(f"sandbox.hosts: a host is listed twice in {list(hosts)}")
    if hosts and not os.environ.get(API_KEY_ENV):
        raise ConfigError(f"sandbox.hosts: set ${API_KEY_ENV} (the hosts' API key) in the trainer's "
                          "environment")
    return list(hosts)


def worker_environment(sandbox: Mapping[str, Any] | None) -> dict[str, str]:
    """What a rollout worker needs in its environment for the run's sandboxes: the hosts' API key
    (from the driver's environment) when ``sandbox.hosts`` is set, else nothing."""
    _config, hosts = split_hosts(sandbox)
    if not hosts:
        return {}
    check_hosts(hosts)
    return {API_KEY_ENV: os.environ[API_KEY_ENV]}


def apply_worker_environment(env: Mapping[str, str]) -> None:
    """In a rollout worker's own process: put the driver's `worker_environment` in place."""
    os.environ.update(env)
