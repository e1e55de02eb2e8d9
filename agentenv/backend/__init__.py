"""Container backends behind one seam (`SandboxBackend`): `fastpath` (agentenv.fastpath, the default)
and `docker-criu` (Docker's own checkpoint API, the fallback). `enabled` in conf/agentenv/fastpath.yaml or
`$AGENTENV_BACKEND` chooses."""

from __future__ import annotations

from pathlib import Path

from agentenv.backend.base import SandboxBackend


def default_backend(home: Path) -> SandboxBackend:
    from agentenv.fastpath.backend import select_backend

    return select_backend(home)
