"""Which backend this process runs: the configured one (conf/agentenv/backend.yaml's `backend`, or
`$AGENTENV_BACKEND`) when this host can run it, else the configured `fallback`, each with the reason it
runs (`agentenv info` shows it); BackendUnavailable with the reason when neither can.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentenv.backend.host import probe
from agentenv.backend.runtime import CriuRuntime
from agentenv.backend.settings import BackendSettings, default_settings_path
from agentenv.backend.warm import WarmRuntime
from agentenv.errors import BackendUnavailable


def select_backend(home: Path, settings: BackendSettings | None = None) -> CriuRuntime:
    """The backend this process uses for the registry at `home` (see the module docstring)."""
    settings = settings or BackendSettings.load()
    where = ("$AGENTENV_BACKEND" if os.environ.get("AGENTENV_BACKEND") == settings.backend
             else f"`backend` in {default_settings_path()}")
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
