"""Errors of the checkpoint runtime (defined with the others in `agentenv.errors`, so that they cross the
API by name): each subclasses the AgentENV error the core raises for the same case."""

from __future__ import annotations

from agentenv.errors import DiskCapExceeded, RestoreNotVerified

__all__ = ["DiskCapExceeded", "RestoreNotVerified"]
