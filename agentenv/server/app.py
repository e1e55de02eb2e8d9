"""The ASGI application of `agentenv serve`: E2B's control plane and envd's data plane on one port.

Routing: `/process.Process/*` and `/filesystem.Filesystem/*` go to the Connect services, everything else
to FastAPI (control plane, `/health`, `/files`, `/openapi.json`). Every request body is capped at
`max_body_bytes` (413), every error is E2B-shaped (`{"code", "message"}`) on HTTP routes and a Connect
error on RPC routes, and a call this server does not implement says so (501).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from agentenv.errors import AgentEnvError, SandboxNotFound
from agentenv.server.envd_fs import files_router, filesystem_app
from agentenv.server.envd_process import process_app
from agentenv.server.errors import ApiError, classify, e2b_json
from agentenv.server.reaper import Reaper
from agentenv.server.state import SANDBOX_ID_HEADER, ServerState, Unauthorized

log = logging.getLogger(__name__)
TITLE = "AgentENV sandboxes (E2B-compatible API)"
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413: by Content-Length up front, else while reading."""

    def __init__(self, app: ASGIApp, limit: int, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.limit = limit
        self.exempt = exempt  # paths that bound their bodies themselves (a moved sandbox's stream)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.limit
                except ValueError:
                    return await e2b_json(400, "invalid Content-Length header")(scope, receive, send)
                if too_big:
                    return await self._refuse(scope, receive, send)
        seen = 0
        started = False

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge
            return msg

        async def tracking_send(msg: dict) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = e2b_json(413, f"request body exceeds the server's max_body_bytes={self.limit}")
        await refusal(scope, receive, send)


class Dispatch:
    """Send Connect RPC paths to their services, everything else to FastAPI."""

    def __init__(self, api: ASGIApp, rpc: dict[str, ASGIApp]) -> None:
        self.api = api
        self.rpc = rpc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            prefix = scope["path"].split("/", 2)[1] if scope["path"].count("/") >= 2 else ""
            app = self.rpc.get(prefix)
            if app is not None:
                return await app(scope, receive, send)
        await self.api(scope, receive, send)


def create_app(state: ServerState, reaper: bool = True) -> ASGIApp:
    """The whole server: body limit, then Connect RPC paths or the FastAPI app."""
    limit = state.settings.max_body_bytes
    rpc = {"process.Process": process_app(state, limit),
           "filesystem.Filesystem": filesystem_app(state, limit)}
    from agentenv.server.moves import IMPORTS_PATH

    return BodyLimit(Dispatch(create_api(state, reaper), rpc), limit, exempt=(IMPORTS_PATH,))


def create_api(state: ServerState, reaper: bool = True) -> FastAPI:
    """The HTTP routes (control plane, /health, /files); `reaper=False` leaves TTL expiry off (for the
    OpenAPI writer, which builds the app without serving it)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        r = Reaper(state.store, state.settings.ttl_check_interval_s,
                   state.settings.liveness_check_interval_s) if reaper else None
        if r:
            r.start()
        try:
            yield
        finally:
            if r:
                r.stop()

    api = FastAPI(title=TITLE, version=state.settings.envd_version, lifespan=lifespan, docs_url=None,
                  redoc_url=None,
                  description="E2B's control plane on AgentENV: Docker sandboxes that pause to zero memory "
                              "(CRIU), resume and fork. Authenticate with X-API-Key.")

    @api.exception_handler(ApiError)
    async def _api_error(_r: Request, e: ApiError) -> Response:
        return e2b_json(e.status, e.message)

    @api.exception_handler(Unauthorized)
    async def _unauthorized(_r: Request, e: Unauthorized) -> Response:
        return e2b_json(401, str(e))

    @api.exception_handler(AgentEnvError)
    async def _agentenv_error(_r: Request, e: AgentEnvError) -> Response:
        status, _code, name = classify(e)
        return e2b_json(status, str(e), name)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError) -> Response:
        parts = []
        for err in e.errors()[:5]:
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return e2b_json(400, "invalid request: " + "; ".join(parts))

    @api.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException) -> Response:
        return e2b_json(e.status_code, str(e.detail))

    @api.exception_handler(Exception)
    async def _unexpected(_r: Request, e: Exception) -> Response:
        log.exception("unexpected error")
        first = str(e).splitlines()[0] if str(e) else ""
        return e2b_json(500, f"internal error: {type(e).__name__}: {first[:300]}")

    @api.get("/health", status_code=204, include_in_schema=False)
    def health(request: Request) -> Response:
        """envd's health probe: 204 when the sandbox named by E2b-Sandbox-Id runs (or none is named),
        502 when it is paused or gone, as E2B's proxy answers (the SDK's `is_running`). A sandbox that is
        gone (killed, TTL) gets the proxy's "... was not found", from which the SDK concludes, after a
        stream broke off, that the sandbox was killed rather than unreachable."""
        sid = request.headers.get(SANDBOX_ID_HEADER)
        if sid:
            try:
                sb, _rec = state.sandbox(sid, probe=True)  # a dead container reads as gone
                status = sb.status
            except SandboxNotFound:
                return e2b_json(502, f"sandbox {sid} was not found (killed, or its time to live ran out)")
            except AgentEnvError as e:
                return e2b_json(502, f"sandbox {sid} is not running: {e}")
            if status != "running":
                return e2b_json(502, f"sandbox {sid} is not running: it is {status}")
        return Response(status_code=204)

    from agentenv.server.control import control_router
    from agentenv.server.moves import moves_router

    api.include_router(files_router(state))
    api.include_router(control_router(state))
    api.include_router(moves_router(state))

    @api.api_route("/{path:path}", methods=list(_METHODS), include_in_schema=False)
    def unsupported(path: str, request: Request) -> Response:
        state.check_api_key(request.headers)
        routes = [r for r in api.routes if r is not catch_all]
        allowed = [m for m in _METHODS
                   if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]
        if allowed:
            return e2b_json(405, f"{request.method} is not allowed on /{path}; use {', '.join(allowed)}")
        return e2b_json(501, f"{request.method} /{path} is not supported by agentenv serve (see "
                             "docs/agentenv.md, 'Serving sandboxes over E2B's API')")

    catch_all = api.routes[-1]

    return api
