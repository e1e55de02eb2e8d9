"""`ServerState`: what every route of `agentenv serve` shares (settings, API key, the E2B side table,
the process manager) and the two checks every request passes: the API key on the control plane, the
sandbox's envd access token on the data plane."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from agentenv import moves
from agentenv.errors import CheckpointError, SandboxNotFound, SandboxStateError
from agentenv.locks import sandbox_lock
from agentenv.moves import MOVING
from agentenv.runtime import runtime
from agentenv.sandbox import Sandbox
from agentenv.server.auth import same_secret
from agentenv.server.errors import to_connect
from agentenv.server.procs import ProcessManager
from agentenv.server.reconcile import gone_reason, settle
from agentenv.server.settings import ServerSettings
from agentenv.server.store import E2BRecord, E2BStore

SANDBOX_ID_HEADER = "e2b-sandbox-id"
ACCESS_TOKEN_HEADER = "x-access-token"
API_KEY_HEADER = "x-api-key"

T = TypeVar("T")


class Unauthorized(Exception):
    """Missing or wrong API key / envd access token (401)."""


@dataclass
class ServerState:
    settings: ServerSettings
    home: Path
    api_key: str
    store: E2BStore
    procs: ProcessManager

    @classmethod
    def open(cls, settings: ServerSettings, api_key: str) -> ServerState:
        home = runtime().home
        return cls(settings, home, api_key, E2BStore(home), ProcessManager(settings.output_poll_s))

    def check_api_key(self, headers: Mapping[str, str]) -> None:
        if not same_secret(headers.get(API_KEY_HEADER), self.api_key):
            given = API_KEY_HEADER in headers
            raise Unauthorized("invalid API key" if given else
                               "missing API key: send it in the X-API-Key header (E2B_API_KEY for the SDK)")

    def sandbox(self, sandbox_id: str, probe: bool = False) -> tuple[Sandbox, E2BRecord]:
        """A sandbox served by this API (created through it), or SandboxNotFound. One whose container
        died behind the server's back (marked broken; with `probe`, also a running one whose container
        is not running) is removed here, and the error says why it is gone, as does every later one."""
        rec = self.store.get(sandbox_id) if sandbox_id else None
        if rec is None:
            raise _not_found(sandbox_id)
        sb = Sandbox.get(sandbox_id)
        status = sb.status
        if status == MOVING:  # a move a dead process left undecided: its destination says how it ended
            status = getattr(moves.settle(sandbox_id), "state", status)
            if status == "closed":
                self.store.delete(sandbox_id)
                raise _not_found(sandbox_id)
        if status == "closed":
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found (it was killed)")
        if status == "broken" or (probe and status == "running"):
            why = settle(self.store, sandbox_id, probe)
            if why is not None:
                raise SandboxNotFound(f"sandbox {sandbox_id!r} is gone: {why}; the server removed it")
        return sb, rec

    def envd_sandbox(self, headers: Mapping[str, str]) -> tuple[Sandbox, E2BRecord]:
        """The sandbox a data-plane request is for (header `E2b-Sandbox-Id`), its token checked."""
        sid = headers.get(SANDBOX_ID_HEADER, "")
        if not sid:
            raise SandboxNotFound("missing E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this server so "
                                  "the SDK sends it")
        rec = self.store.get(sid)
        if rec is None:
            raise _not_found(sid)
        if not same_secret(headers.get(ACCESS_TOKEN_HEADER), rec.envd_token):
            raise Unauthorized("missing or invalid envd access token (X-Access-Token) for sandbox " + sid)
        return self.sandbox(sid)

    @contextlib.contextmanager
    def gone_if_broken(self, sb: Sandbox) -> Iterator[None]:
        """Around an operation on `sb`: when it fails because the sandbox's container died under it (the
        sandbox is then marked broken), the sandbox is removed and SandboxNotFound says why it is gone,
        instead of a state or checkpoint error (409, 500) that would read as a refusal or a server bug."""
        try:
            yield
        except (SandboxStateError, CheckpointError):
            why = settle(self.store, sb.id) if sb.status == "broken" else None
            if why is None:
                raise
            raise SandboxNotFound(f"sandbox {sb.id!r} is gone: {why}; the server removed it") from None

    @contextlib.contextmanager
    def serialised(self, sb: Sandbox, action: str) -> Iterator[None]:
        """Hold the sandbox's registry lock (agentenv.locks) around a data-plane operation, so that it
        never overlaps a pause, fork or kill of the same sandbox, nor another request on it."""
        with sandbox_lock(runtime().registry.lock_dir, sb.id, sb.config.lock_timeout_s, action):
            yield


    async def envd_call(self, headers: Mapping[str, str], fn: Callable[[Sandbox], T], action: str) -> T:
        """`fn(sandbox)` for a data-plane RPC: the request's sandbox (token checked), in a worker thread,
        under the sandbox's lock; every error as a Connect error (`agentenv.server.errors`)."""

        def run() -> T:
            sb, _rec = self.envd_sandbox(headers)
            with self.gone_if_broken(sb), self.serialised(sb, action):
                return fn(sb)
        try:
            return await asyncio.to_thread(run)
        except Unauthorized as e:
            raise ConnectError(Code.UNAUTHENTICATED, str(e)) from None
        except Exception as e:
            raise to_connect(e) from None


def _not_found(sandbox_id: str) -> SandboxNotFound:
    """Not served (any more): with why, when the server removed it because its container died."""
    moved = moves.moved_to(runtime().registry.get_sandbox(sandbox_id) if sandbox_id else None)
    if moved is not None:
        return SandboxNotFound(f"sandbox {sandbox_id!r} is not here: it moved to {moved}")
    why = gone_reason(sandbox_id)
    return SandboxNotFound(f"sandbox {sandbox_id!r} not found" +
                           (f": it is gone ({why}); the server removed it" if why else ""))
