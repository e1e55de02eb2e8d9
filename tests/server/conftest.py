"""Fixtures for `agentenv serve` tests: a real Docker daemon and base image, a private $AGENTENV_HOME, and
the server itself started as `agentenv serve` in a subprocess on a free loopback port, with the
unmodified `e2b` SDK pointed at it through E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from netns_hosts import Server, loopback_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """`agentenv serve` on a free port with a private home (`netns_hosts.loopback_server`), with the
    E2B SDK's environment pointed at it; its sandboxes are removed at the end."""
    with loopback_server(tmp_path_factory.mktemp("agentenv-serve-home")) as srv:
        old = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.api_key)
        os.environ.pop("E2B_DOMAIN", None)
        try:
            yield srv
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture
def sdk_sandbox(server) -> Iterator:
    """Factory of SDK sandboxes (`e2b.Sandbox.create` keyword arguments), killed after the test."""
    from e2b import Sandbox

    made = []

    def make(template: str = "base", **kw):
        sb = Sandbox.create(template, **kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        try:
            sb.kill()
        except Exception:
            pass
