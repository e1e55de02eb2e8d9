"""envd's file API: the `filesystem.Filesystem` Connect service (generated `FilesystemASGIApplication`
from the `e2b` package) and the HTTP routes `GET/POST /files`, all confined to the sandbox's work dir."""

from __future__ import annotations

import asyncio
import posixpath
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from fastapi import APIRouter, Request
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.responses import Response

from agentenv.sandbox import Sandbox
from agentenv.server import fsops
from agentenv.server.errors import ApiError
from agentenv.server.state import ServerState, Unauthorized

T = TypeVar("T")
_TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY}


def _entry(e: fsops.Entry) -> pb.EntryInfo:
    secs = int(e.mtime)
    return pb.EntryInfo(name=e.name, type=_TYPES.get(e.type, pb.FileType.UNSPECIFIED), path=e.path,
                        size=e.size, mode=e.mode, permissions=e.permissions, owner=e.owner, group=e.group,
                        modified_time=Timestamp(seconds=secs, nanos=int((e.mtime - secs) * 1e9)),
                        symlink_target=e.symlink_target, is_symlink=e.is_symlink)


class FilesystemService:
    """Stat, MakeDir, Move, ListDir, Remove; the watch calls are not supported and say so."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _call(self, ctx: RequestContext, fn: Callable[[Sandbox], T], action: str) -> Awaitable[T]:
        return self.state.envd_call(ctx.request_headers, fn, action)

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

    def watch_dir(self, request: pb.WatchDirRequest,
                  ctx: RequestContext) -> AsyncIterator[pb.WatchDirResponse]:
        raise ConnectError(Code.UNIMPLEMENTED, _NO_WATCH)

    async def create_watcher(self, request: pb.CreateWatcherRequest,
                             ctx: RequestContext) -> pb.CreateWatcherResponse:
        raise ConnectError(Code.UNIMPLEMENTED, _NO_WATCH)

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest,
                                 ctx: RequestContext) -> pb.GetWatcherEventsResponse:
        raise ConnectError(Code.UNIMPLEMENTED, _NO_WATCH)

    async def remove_watcher(self, request: pb.RemoveWatcherRequest,
                             ctx: RequestContext) -> pb.RemoveWatcherResponse:
        raise ConnectError(Code.UNIMPLEMENTED, _NO_WATCH)


_NO_WATCH = "filesystem watching (files.watch_dir) is not supported by agentenv serve"


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


def files_router(state: ServerState) -> APIRouter:
    """`GET /files?path=` (download) and `POST /files?path=` (upload: octet-stream or multipart)."""
    router = APIRouter()

    def envd(request: Request) -> Sandbox:
        try:
            sb, _rec = state.envd_sandbox(request.headers)
        except Unauthorized as e:
            raise ApiError(401, str(e)) from None
        return sb

    @router.get("/files", include_in_schema=False)
    def download(request: Request, path: str | None = None) -> Response:
        if not path:
            raise ApiError(400, "query parameter `path` is required")
        sb = envd(request)
        if fsops.sandbox_path(sb, path) == sb.config.workspace.rstrip("/"):
            raise ApiError(400, f"{path!r} is the work dir, a directory: give a file path")
        with state.serialised(sb, "read a file"):
            data = sb.read_file(path)  # FileNotFoundInSandbox (404) when the file is not there
        name = posixpath.basename(path)
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    @router.post("/files", include_in_schema=False)
    async def upload(request: Request, path: str | None = None) -> list[dict]:
        sb = await asyncio.to_thread(envd, request)
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
        for name, _ in files:
            if not name:
                raise ApiError(400, "a file part has no path: give `path` or a file name per part")

        def write() -> list[dict]:
            out = []
            with state.serialised(sb, "write files"):
                for name, data in files:
                    full = fsops.sandbox_path(sb, name)
                    sb.write_file(full, data)
                    out.append({"name": posixpath.basename(full), "type": "file", "path": full})
            return out
        return await asyncio.to_thread(write)

    return router
