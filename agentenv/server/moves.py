"""AgentENV's routes for moving paused sandboxes between `agentenv serve` hosts (`agentenv.moves` on the
source, `agentenv.imports` on the destination; docs/agentenv.md, "Moving a paused sandbox").

The stream's body is exempt from `max_body_bytes` (the store's `disk_cap` bounds it) and reaches the
import's worker thread through a bounded queue.

Design: docs/design/sandboxes.md#agentenv-server-moves.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from agentenv import imports, moves
from agentenv.errors import CheckpointError, InvalidArgument, SandboxNotFound
from agentenv.sandbox import Sandbox, inherited_labels
from agentenv.server.control import _ERRORS, CreatedSandbox, api_key_dependency
from agentenv.server.errors import ApiError
from agentenv.server.state import ServerState
from agentenv.server.store import AUTO_PAUSE_LABEL, ENV_LABEL, METADATA_LABEL, TEMPLATE_LABEL

IMPORTS_PATH = "/agentenv/imports"
STREAM_TYPE = "application/octet-stream"
QUEUE_DEPTH = 16        # body chunks (uvicorn hands over up to 256 KiB each) between the loop and the import
IDLE_S = 120.0          # an import whose source sends nothing for this long fails


class MoveBody(BaseModel):
    to: str = Field(min_length=8, max_length=2048, description="the destination `agentenv serve` URL")
    timeout: int | None = Field(None, ge=0, description="its time to live there (default: that host's)")
    apiKey: str | None = Field(None, min_length=16, max_length=512,
                               description="the destination's API key (default: this server's own)")


class MovedSandbox(CreatedSandbox):
    host: str = Field(description="where the sandbox runs now")
    timings: dict[str, Any] = Field(description="seconds each step took, here and there")


class ImportedSandbox(CreatedSandbox):
    timings: dict[str, float] = Field(description="seconds each step of the import took here")


class ImportStatus(BaseModel):
    move_id: str
    sandbox_id: str | None = None
    state: Literal["receiving", "restoring", "done", "failed", "absent"]
    reason: str | None = None


class CheckAnswer(BaseModel):
    ok: bool = True


class _Body:
    """The request body, from the event loop (`put`) to the import's thread (`read`), at most
    `QUEUE_DEPTH` chunks in between."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._q: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self._loop = loop
        self._room = asyncio.Event()
        self._waiting = False
        self._closed = False
        self._broken: BaseException | None = None
        self._view = memoryview(b"")

    async def put(self, item: bytes | None) -> None:
        """A chunk, or the end (None); waits while the queue is full."""
        while not self._closed:
            try:
                self._q.put_nowait(item)
                return
            except queue.Full:
                self._room.clear()
                self._waiting = True
                if not self._q.full():
                    continue
                await self._room.wait()

    def read(self, n: int) -> memoryview:
        """Up to `n` bytes (empty at the end); CheckpointError when the body broke off or stalled."""
        deadline = time.monotonic() + IDLE_S
        while not self._view:
            if self._broken is not None:
                raise CheckpointError(f"the move's stream broke off: {self._broken}")
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"the source sent nothing for {IDLE_S:g} s") from None
                continue
            if self._waiting:
                self._waiting = False
                self._loop.call_soon_threadsafe(self._room.set)
            if item is None:
                return memoryview(b"")
            self._view = memoryview(item)
        out, self._view = self._view[:n], self._view[n:]
        return out

    def break_off(self, why: BaseException) -> None:
        """The body will not go on (the source disconnected): `read` raises from now on."""
        self._broken = why

    def close(self) -> None:
        """The import is over: `put` drops what comes from now on."""
        self._closed = True
        self._loop.call_soon_threadsafe(self._room.set)


def served_facts(sandbox: Mapping[str, Any]) -> tuple[str, dict[str, str], dict[str, str], bool]:
    """(template, metadata, environment, autoPause) of a moved sandbox, from the E2B labels it carries when
    its source served it, else its image tag and nothing."""
    labels = sandbox.get("labels") or {}
    try:
        metadata, env = json.loads(labels[METADATA_LABEL]), json.loads(labels[ENV_LABEL])
        return str(labels[TEMPLATE_LABEL]), dict(metadata), dict(env), labels.get(AUTO_PAUSE_LABEL) == "1"
    except (KeyError, ValueError, TypeError):
        return str(sandbox.get("image")), {}, {}, False


def moves_router(state: ServerState) -> APIRouter:
    settings = state.settings
    r = APIRouter(dependencies=[Depends(api_key_dependency(state))], responses=_ERRORS, tags=["moves"])

    def ttl(timeout: int | None) -> int:
        t = settings.default_timeout_s if timeout is None else timeout
        if t > settings.max_timeout_s:
            raise ApiError(400, f"timeout {t} s exceeds the server's max_timeout_s={settings.max_timeout_s}")
        return t

    @r.post("/sandboxes/{sandbox_id}/agentenv/move", response_model=MovedSandbox,
            summary="Move a paused sandbox to another agentenv serve host, which resumes it; this host keeps "
                    "it until that host confirms a verified restore")
    def move(sandbox_id: str, body: MoveBody) -> MovedSandbox:
        timeout = ttl(body.timeout) if body.timeout is not None else None
        sb, rec = state.sandbox(sandbox_id)
        done = moves.move(sb, body.to, api_key=body.apiKey or state.api_key, timeout_s=timeout)
        state.store.delete(sb.id)
        answer = done.answer
        return MovedSandbox(templateID=answer.get("templateID", rec.template_id), sandboxID=sb.id,
                            clientID=answer.get("clientID", "agentenv"),
                            envdVersion=answer.get("envdVersion", settings.envd_version),
                            envdAccessToken=answer.get("envdAccessToken", ""), host=done.url,
                            timings=done.timings)

    @r.post(f"{IMPORTS_PATH}/check", response_model=CheckAnswer,
            summary="Can this host take the sandbox a move's manifest describes (image, CRIU, kernel, id)?")
    def check(manifest: dict[str, Any]) -> CheckAnswer:
        imports.check(manifest)
        return CheckAnswer()

    def labels_for(sandbox: Mapping[str, Any]) -> dict[str, str]:
        own = state.store.served_labels(*served_facts(sandbox))
        return {**inherited_labels(sandbox.get("labels") or {}), **own}

    def take(body: _Body, timeout: int) -> dict[str, Any]:
        try:
            taken = imports.take(body.read, labels_for)
        finally:
            body.close()
        sb = Sandbox.get(taken.sandbox_id)
        state.store.row_from_labels(sb._record(), timeout)
        rec = state.store.get(sb.id)
        if rec is None:  # cannot happen with the labels set above; the restart rebuilds it anyway
            raise SandboxNotFound(f"sandbox {sb.id} runs here but has no E2B row")
        return {"templateID": rec.template_id, "sandboxID": sb.id, "clientID": "agentenv",
                "envdVersion": settings.envd_version, "envdAccessToken": rec.envd_token,
                "timings": taken.timings}

    @r.post(IMPORTS_PATH, status_code=201, response_model=ImportedSandbox,
            summary="Take in a moved sandbox: its stream (a tar archive); answers once it runs here",
            openapi_extra={"requestBody": {"required": True, "content": {
                STREAM_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
    async def take_in(request: Request, timeout: int | None = Query(None, ge=0)) -> ImportedSandbox:
        if request.headers.get("content-type", "").split(";")[0].strip() != STREAM_TYPE:
            raise InvalidArgument(f"a move's stream is sent as Content-Type: {STREAM_TYPE}")
        life = ttl(timeout)
        loop = asyncio.get_running_loop()
        body = _Body(loop)
        job = loop.run_in_executor(None, take, body, life)
        try:
            async for chunk in request.stream():
                if chunk and not job.done():  # a failed import: the rest is read and dropped
                    await body.put(chunk)
            await body.put(None)
        except ClientDisconnect:
            body.break_off(ConnectionError("the source's connection closed"))
        except BaseException as e:
            body.break_off(e)
            raise
        return ImportedSandbox(**await job)

    @r.get(f"{IMPORTS_PATH}/{{move_id}}", response_model=ImportStatus,
           summary="What became of a move to this host; a move never seen is recorded `absent` (it can never "
                   "arrive later)")
    def import_status(move_id: str) -> ImportStatus:
        return ImportStatus(**imports.status(move_id))

    return r

