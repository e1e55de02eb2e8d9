"""envd's file API: the `filesystem.Filesystem` Connect service (generated `FilesystemASGIApplication`
from the `e2b` package) and the HTTP routes `GET/POST /files`, all confined to the sandbox's work dir."""

from __future__ import annotations

import asyncio
import posixpath
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from fastapi import APIRouter, Request
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.responses import Response

from agentenv.errors import AgentEnvError, FileNotFoundInSandbox, InvalidArgument
from agentenv.sandbox import Sandbox
from agentenv.server import fsops
from agentenv.server.errors import ApiError, to_connect
from agentenv.server.signing import BadSignature, signer
from agentenv.server.state import SANDBOX_ID_HEADER, ServerState, Unauthorized
from agentenv.server.users import basic_auth_user, check_user
from agentenv.server.watch import Watch, Watches, event_path

T = TypeVar("T")
_TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY}


def _entry(e: fsops.Entry) -> pb.EntryInfo:
    secs = int(e.mtime)
    return pb.EntryInfo(name=e.name, type=_TYPES.get(e.type, pb.FileType.UNSPECIFIED), path=e.path,
                        size=e.size, mode=e.mode, permissions=e.permissions, owner=e.owner, group=e.group,
                        modified_time=Timestamp(seconds=secs, nanos=int((e.mtime - secs) * 1e9)),
                        symlink_target=e.symlink_target, is_symlink=e.is_symlink,
                        metadata=dict(e.metadata) or None)


class FilesystemService:
    """Stat, MakeDir, Move, ListDir, Remove, and the watch calls (`watch.Watches`)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.watches = Watches()

    def _call(self, ctx: RequestContext, fn: Callable[[Sandbox], T], action: str) -> Awaitable[T]:
        try:
            user = basic_auth_user(ctx.request_headers)
        except InvalidArgument as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None

        def checked(sb: Sandbox) -> T:
            check_user(user, action, sb)
            return fn(sb)
        return self.state.envd_call(ctx.request_headers, checked, action)

    async def stat(self, request: pb.StatRequest, ctx: RequestContext) -> pb.StatResponse:
        e = await self._call(ctx, lambda sb: fsops.stat(sb, request.path), "stat")
        return pb.StatResponse(entry=_entry(e))

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext) -> pb.MakeDirResponse:
        e = await self._call(ctx, lambda sb: fsops.make_dir(sb, request.path), "make a directory")
        return pb.MakeDirResponse(entry=_entry(e))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext) -> pb.MoveResponse:
        e = await self._call(ctx, lambda sb: fsops.move(sb, request.source, request.destination), "move")
        return pb.MoveResponse(entry=_entry(e))

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext) -> pb.ListDirResponse:
        depth = request.depth or 1
        entries = await self._call(ctx, lambda sb: fsops.list_dir(sb, request.path, depth), "list")
        return pb.ListDirResponse(entries=[_entry(e) for e in entries])

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext) -> pb.RemoveResponse:
        await self._call(ctx, lambda sb: fsops.remove(sb, request.path), "remove")
        return pb.RemoveResponse()

    # ---- watching (files.watch_dir) -----------------------------------------------------------------
    def _watch(self, sb: Sandbox, path: str, recursive: bool, include_entry: bool) -> Watch:
        for w in self.watches.stale():
            self.watches.remove(w)
        return self.watches.create(sb, path, recursive, include_entry)

    def _events(self, sb: Sandbox, watch: Watch) -> list[pb.FilesystemEvent]:
        out = []
        for ev in watch.watcher.drain():
            entry = None
            if watch.include_entry and ev.kind != "remove":
                try:  # best effort, as envd: the path may be gone again
                    entry = _entry(fsops.stat(sb, event_path(watch, ev)))
                except (FileNotFoundInSandbox, AgentEnvError):
                    entry = None
            out.append(pb.FilesystemEvent(name=ev.name, type=_EVENTS[ev.kind], entry=entry))
        return out

    async def watch_dir(self, request: pb.WatchDirRequest,
                        ctx: RequestContext) -> AsyncIterator[pb.WatchDirResponse]:
        """A stream of the directory's events (inotify on the host), until the client leaves or the
        sandbox stops running; a keep-alive every KEEPALIVE_S."""
        watch = await self._call(ctx, lambda sb: self._watch(sb, request.path, request.recursive,
                                                             request.include_entry), "watch a directory")
        try:
            yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))
            quiet = 0.0
            while True:
                await asyncio.sleep(_WATCH_POLL_S)
                sb, _rec = await asyncio.to_thread(self.state.sandbox, watch.sandbox_id)
                if sb.status != "running":
                    raise ConnectError(Code.UNAVAILABLE, f"sandbox {sb.id} is {sb.status}: the watch ended")
                try:
                    events = await asyncio.to_thread(self._events, sb, watch)
                except AgentEnvError as e:  # its tree grew past what it may watch (WatchLimitReached)
                    raise to_connect(e) from None
                for ev in events:
                    yield pb.WatchDirResponse(event=Oneof("filesystem", ev))
                quiet = 0.0 if events else quiet + _WATCH_POLL_S
                if quiet >= _KEEPALIVE_S:
                    quiet = 0.0
                    yield pb.WatchDirResponse(event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive()))
        finally:
            self.watches.remove(watch.id)

    async def create_watcher(self, request: pb.CreateWatcherRequest,
                             ctx: RequestContext) -> pb.CreateWatcherResponse:
        watch = await self._call(ctx, lambda sb: self._watch(sb, request.path, request.recursive,
                                                             request.include_entry), "watch a directory")
        return pb.CreateWatcherResponse(watcher_id=watch.id)

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest,
                                 ctx: RequestContext) -> pb.GetWatcherEventsResponse:
        def events(sb: Sandbox) -> list[pb.FilesystemEvent]:
            return self._events(sb, self.watches.get(request.watcher_id, sb))
        return pb.GetWatcherEventsResponse(events=await self._call(ctx, events, "read watcher events"))

    async def remove_watcher(self, request: pb.RemoveWatcherRequest,
                             ctx: RequestContext) -> pb.RemoveWatcherResponse:
        def remove(sb: Sandbox) -> None:
            self.watches.get(request.watcher_id, sb)  # it must be this sandbox's
            self.watches.remove(request.watcher_id)
        await self._call(ctx, remove, "remove a watcher")
        return pb.RemoveWatcherResponse()


_WATCH_POLL_S = 0.05
_KEEPALIVE_S = 30.0
_EVENTS = {"create": pb.EventType.CREATE, "write": pb.EventType.WRITE, "remove": pb.EventType.REMOVE,
           "rename": pb.EventType.RENAME, "chmod": pb.EventType.CHMOD}


def filesystem_app(state: ServerState, read_max_bytes: int) -> FilesystemASGIApplication:
    return FilesystemASGIApplication(FilesystemService(state), read_max_bytes=read_max_bytes)


# ---- HTTP /files ----------------------------------------------------------------------------------
def _gunzip(data: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise ApiError(400, f"Content-Encoding gzip, but the body is not gzip data: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise ApiError(413, f"the decompressed file exceeds {limit} bytes")
    return out


_META_PREFIX = "x-metadata-"
_META_KEY = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")
_META_VALUE = re.compile(r"^[\x20-\x7e]*$")


def _metadata(request: Request) -> dict[str, str]:
    """The file metadata of an upload (`X-Metadata-<key>: <value>` headers; keys lowercased, as envd's)."""
    out = {}
    for key, value in request.headers.items():
        if key.startswith(_META_PREFIX):
            name = key[len(_META_PREFIX):]
            if not _META_KEY.match(name) or not _META_VALUE.match(value):
                raise ApiError(400, f"invalid file metadata {name!r}: keys are header tokens, values "
                                    "printable ASCII")
            out[name] = value
    return out


def files_router(state: ServerState) -> APIRouter:
    """`GET /files?path=` (download) and `POST /files?path=` (upload: octet-stream or multipart); with the
    envd access token, or with a URL signed by it (`signature`, `signature_expiration`)."""
    router = APIRouter()

    def envd(request: Request, operation: str, path: str | None) -> Sandbox:
        sb = envd_sandbox(request, operation, path)
        try:
            check_user(request.query_params.get("username"), f"{operation} of {path!r}", sb)
        except InvalidArgument as e:
            raise ApiError(400, str(e)) from None
        return sb

    def envd_sandbox(request: Request, operation: str, path: str | None) -> Sandbox:
        q = request.query_params
        signature = q.get("signature")
        try:
            if signature is None or request.headers.get("x-access-token"):
                sb, _rec = state.envd_sandbox(request.headers)
                return sb
            named = request.headers.get(SANDBOX_ID_HEADER)
            ids = [named] if named else state.store.ids()
            records = [rec for rec in map(state.store.get, ids) if rec is not None]
            sid = signer(records, signature, path or "", operation, q.get("username"),
                         q.get("signature_expiration"))
        except (Unauthorized, BadSignature) as e:
            raise ApiError(401, str(e)) from None
        return state.sandbox(sid)[0]

    @router.get("/files", include_in_schema=False)
    def download(request: Request, path: str | None = None) -> Response:
        if not path:
            raise ApiError(400, "query parameter `path` is required")
        sb = envd(request, "read", path)
        full = fsops.physical(sb, fsops.sandbox_path(sb, path))
        if full == sb.config.workspace.rstrip("/"):
            raise ApiError(400, f"{path!r} is the work dir, a directory: give a file path")
        with state.serialised(sb, "read a file"):
            data = sb.read_file(full)  # FileNotFoundInSandbox (404) when the file is not there
        name = posixpath.basename(path)
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    @router.post("/files", include_in_schema=False)
    async def upload(request: Request, path: str | None = None) -> list[dict]:
        sb = await asyncio.to_thread(envd, request, "write", path)
        metadata = _metadata(request)
        limit = sb.config.file_limit_bytes
        ctype = request.headers.get("content-type", "")
        files: list[tuple[str, bytes]] = []
        if ctype.startswith("multipart/form-data"):
            form = await request.form(max_files=1000, max_fields=1000, max_part_size=limit)
            for key, value in form.multi_items():
                if key != "file" or isinstance(value, str):
                    continue
                files.append((path if path and len(form.getlist("file")) == 1 else value.filename or "",
                              await value.read()))
            if not files:
                raise ApiError(400, "multipart upload without a `file` part")
        elif ctype.startswith("application/octet-stream") or not ctype:
            if not path:
                raise ApiError(400, "query parameter `path` is required for an octet-stream upload")
            body = await request.body()
            if request.headers.get("content-encoding", "").lower() == "gzip":
                body = _gunzip(body, limit)
            elif request.headers.get("content-encoding", "identity").lower() != "identity":
                raise ApiError(415, "unsupported Content-Encoding "
                               f"{request.headers['content-encoding']!r}: use gzip or none")
            files.append((path, body))
        else:
            raise ApiError(415, f"unsupported Content-Type {ctype!r}: use application/octet-stream or "
                                "multipart/form-data")
        for name, data in files:
            if not name:
                raise ApiError(400, "a file part has no path: give `path` or a file name per part")
            if len(data) > limit:
                raise ApiError(413, f"{name!r} exceeds the sandbox's file_limit_bytes={limit}")

        def write() -> list[dict]:
            out = []
            with state.serialised(sb, "write files"):
                for name, data in files:
                    e = fsops.write(sb, name, data, metadata)
                    out.append({"name": e.name, "type": "file", "path": e.path,
                                **({"metadata": e.metadata} if e.metadata else {})})
            return out
        return await asyncio.to_thread(write)

    return router
