"""Container backends behind one seam (`SandboxBackend`); `docker-criu` is the one implemented."""

from __future__ import annotations

from pathlib import Path

from agentenv.backend.base import SandboxBackend


def default_backend(home: Path) -> SandboxBackend:
    from agentenv.backend.docker_criu import DockerCriuBackend

    return DockerCriuBackend(home)
