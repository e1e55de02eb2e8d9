"""Which backend this process runs: the configured one (conf/agentenv/backend.yaml's `backend`, or
`$AGENTENV_BACKEND`) when this host can run it, else the configured `fallback`, each with the reason it
runs (`agentenv info` shows it); BackendUnavailable with the reason when neither can.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentenv.backend.base import SandboxBackend
from agentenv.backend.host import probe
from agentenv.backend.runtime import CriuRuntime
from agentenv.backend.settings import BackendSettings, default_settings_path
from agentenv.backend.warm import WarmRuntime
from agentenv.errors import BackendUnavailable


def select_backend(home: Path, settings: BackendSettings | None = None) -> SandboxBackend:
    """The backend this process uses for the registry at `home` (see the module docstring)."""
    settings = settings or BackendSettings.load()
    where = ("$AGENTENV_BACKEND" if os.environ.get("AGENTENV_BACKEND") == settings.backend
             else f"`backend` in {default_settings_path()}")
    if settings.backend == "microvm":
        return _microvm(home, settings, where)
    try:
        host = probe(settings)
    except BackendUnavailable as e:
        if settings.fallback in ("none", settings.backend):
            raise BackendUnavailable(
                f"the configured AgentENV backend {settings.backend!r} ({where}) cannot run on this host: "
                f"{e}. Fix that, or set `fallback: docker-criu` in {default_settings_path()} to use Docker's "
                "checkpoint path instead") from None
        host = probe(settings, settings.fallback)
        return _runtime(settings.fallback)(home, settings, host, settings.fallback,
                           reason=f"fallback: the configured backend {settings.backend!r} ({where}) cannot "
                                  f"run here ({e}); `fallback: {settings.fallback}` is configured")
    return _runtime(settings.backend)(home, settings, host, settings.backend, reason=f"configured ({where})")


def _runtime(name: str) -> type[CriuRuntime]:
    return WarmRuntime if name == "warm" else CriuRuntime


def _microvm(home: Path, settings: BackendSettings, where: str) -> SandboxBackend:
    """The microvm backend (imported only when configured), or the fallback when it cannot run here."""
    from agentenv.backend.microvm.runtime import MicroVMRuntime

    try:
        return MicroVMRuntime(home, settings, "microvm", reason=f"configured ({where})")
    except BackendUnavailable as e:
        if settings.fallback == "none":
            raise BackendUnavailable(
                f"the configured AgentENV backend 'microvm' ({where}) cannot run on this host: {e}. Fix "
                f"that, or set `fallback: docker-criu` in {default_settings_path()} to use containers "
                "instead") from None
        host = probe(settings, settings.fallback)
        return CriuRuntime(home, settings, host, settings.fallback,
                           reason=f"fallback: the configured backend 'microvm' ({where}) cannot run here "
                                  f"({e}); `fallback: {settings.fallback}` is configured")
