"""envd's `process.Process` Connect service, served by the generated `ProcessASGIApplication` that ships
in the `e2b` package (connectrpc does the framing and the JSON/binary codecs); processes are run by
`procs.ProcessManager` inside the sandbox the request's `E2b-Sandbox-Id` names."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof
from protobuf.wkt.google.protobuf.wrappers_pb import StringValue

from agentenv.errors import InvalidArgument
from agentenv.sandbox import Sandbox
from agentenv.server.errors import classify, to_connect
from agentenv.server.procs import OutputEvent, SandboxKilled
from agentenv.server.state import ServerState
from agentenv.server.users import basic_auth_user, check_user

T = TypeVar("T")
log = logging.getLogger(__name__)
_CLOCK_SLACK_S = 1.0  # the client's deadline starts before ours: a disconnect this close to it is the timeout
_SIGNALS = {pb.Signal.SIGTERM: "TERM", pb.Signal.SIGKILL: "KILL"}


def _started(pid: int) -> pb.ProcessEvent:
    return pb.ProcessEvent(event=Oneof("start", pb.ProcessEvent.StartEvent(pid=pid)))


def _event(ev: OutputEvent) -> pb.ProcessEvent:
    if ev.kind == "end":
        code = ev.exit_code
        status = f"exit status {code}" if code < 128 else f"signal: {code - 128} (exit status {code})"
        return pb.ProcessEvent(event=Oneof("end", pb.ProcessEvent.EndEvent(
            exit_code=code, exited=code < 128, status=status)))
    return pb.ProcessEvent(event=Oneof("data", pb.ProcessEvent.DataEvent(output=Oneof(ev.kind, ev.data))))


class ProcessService:
    """Start/Connect stream events (with a PTY too); List/SendInput/SendSignal/CloseStdin/Update (PTY
    resize) are unary. StreamInput is not supported and says so."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _call(self, ctx: RequestContext, fn: Callable[[Sandbox], T], action: str) -> Awaitable[T]:
        return self.state.envd_call(ctx.request_headers, fn, action)

    def _selector(self, sel: pb.ProcessSelector | None) -> tuple[int | None, str | None]:
        if sel is None or sel.selector is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "process selector missing: give a pid or a tag")
        if sel.selector.field == "pid":
            return int(sel.selector.value), None
        return None, str(sel.selector.value)

    async def _pid(self, ctx: RequestContext, sel: pb.ProcessSelector | None) -> tuple[Sandbox, int]:
        pid, tag = self._selector(sel)
        return await self._call(ctx, lambda sb: (sb, self.state.procs.resolve(sb, pid, tag)), "find process")

    # ---- streams ---------------------------------------------------------------------------------
    async def start(self, request: pb.StartRequest, ctx: RequestContext) -> AsyncIterator[pb.StartResponse]:
        size = None
        if request.pty is not None:
            sz = request.pty.size
            size = (sz.rows, sz.cols) if sz is not None else (24, 80)
        cfg = request.process
        if cfg is None or not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "StartRequest.process.cmd is required")
        try:
            user = basic_auth_user(ctx.request_headers)
        except InvalidArgument as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None

        def launch(sb: Sandbox) -> tuple[Sandbox, int]:
            check_user(user, f"starting {cfg.cmd!r}", sb)
            _sb, rec = self.state.sandbox(sb.id)
            envs = {**rec.env_vars, **dict(cfg.envs or {})}
            return sb, self.state.procs.start(sb, cfg.cmd, list(cfg.args), envs, cfg.cwd or None,
                                              bool(request.stdin), request.tag, size)
        deadline = _deadline(ctx)
        sb, pid = await self._call(ctx, launch, "start a process")
        yield pb.StartResponse(event=_started(pid))
        async for ev in self._follow(ctx, sb, pid, True, deadline):
            yield pb.StartResponse(event=ev)

    async def connect(self, request: pb.ConnectRequest,
                      ctx: RequestContext) -> AsyncIterator[pb.ConnectResponse]:
        deadline = _deadline(ctx)
        sb, pid = await self._pid(ctx, request.process)
        yield pb.ConnectResponse(event=_started(pid))
        async for ev in self._follow(ctx, sb, pid, False, deadline):
            yield pb.ConnectResponse(event=ev)

    async def _follow(self, ctx: RequestContext, sb: Sandbox, pid: int, from_start: bool,
                      deadline: float | None) -> AsyncIterator[pb.ProcessEvent]:
        """Events until the end; at the client's deadline the process group is killed (as envd does
        when a command's timeout runs out) and DEADLINE_EXCEEDED ends the stream."""
        events = self.state.procs.follow(sb, pid, from_start)
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                try:
                    ev = await asyncio.wait_for(anext(events), remaining)
                except StopAsyncIteration:
                    return
                yield _event(ev)
        except TimeoutError:
            await events.aclose()
            await self._call(ctx, lambda s: self.state.procs.signal(s, pid, "KILL"), "kill a process")
            raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {pid} ran past the request's timeout; "
                                                       "it was killed") from None
        except ConnectError:
            raise
        except SandboxKilled as e:
            # envd's stream breaks off when its sandbox dies: `unavailable`, which sends the SDK to the
            # health probe (GET /health: 502 "... was not found"), so it raises its not-running error.
            _status, _code, name = classify(e)  # our type name still travels, for agentenv.remote
            details = [StringValue(value=name)] if name else []
            raise ConnectError(Code.UNAVAILABLE, str(e), details=details) from None
        except (GeneratorExit, asyncio.CancelledError):
            # The client went away. At (about) its deadline that is the command's timeout running out
            # on the client's clock first: kill it as above, without awaiting (the stream is closing).
            if deadline is not None and time.monotonic() >= deadline - _CLOCK_SLACK_S:
                headers = ctx.request_headers
                threading.Thread(target=self._kill_quietly, args=(headers, pid), daemon=True).start()
            raise
        except Exception as e:
            raise to_connect(e) from None
        finally:
            await events.aclose()

    def _kill_quietly(self, headers, pid: int) -> None:
        try:
            sb, _rec = self.state.envd_sandbox(headers)
            with self.state.serialised(sb, "kill a timed-out process"):
                self.state.procs.signal(sb, pid, "KILL")
        except Exception as e:  # the sandbox may be gone or paused meanwhile: nothing left to kill
            log.info("could not kill timed-out process %s: %s", pid, e)

    # ---- unary -----------------------------------------------------------------------------------
    async def list(self, request: pb.ListRequest, ctx: RequestContext) -> pb.ListResponse:
        infos = await self._call(ctx, self.state.procs.list, "list processes")
        return pb.ListResponse(processes=[
            pb.ProcessInfo(pid=i.pid, tag=i.tag, config=pb.ProcessConfig(cmd=i.cmd, args=i.args, envs=i.envs,
                                                                          cwd=i.cwd))
            for i in infos])

    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext) -> pb.SendInputResponse:
        data = request.input.input if request.input is not None else None
        if data is None or data.field not in ("stdin", "pty"):
            raise ConnectError(Code.INVALID_ARGUMENT, "SendInput needs input.stdin or input.pty bytes")
        sb, pid = await self._pid(ctx, request.process)
        await self._call(ctx, lambda s: self.state.procs.send_input(s, pid, bytes(data.value)), "send input")
        return pb.SendInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: RequestContext) -> pb.SendSignalResponse:
        name = _SIGNALS.get(request.signal)
        if name is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal!r}: SIGTERM or "
                                                      "SIGKILL")
        sb, pid = await self._pid(ctx, request.process)
        await self._call(ctx, lambda s: self.state.procs.signal(s, pid, name), "signal a process")
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: RequestContext) -> pb.CloseStdinResponse:
        sb, pid = await self._pid(ctx, request.process)
        await self._call(ctx, lambda s: self.state.procs.close_stdin(s, pid), "close stdin")
        return pb.CloseStdinResponse()

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        """Resize a PTY process's terminal (the only update envd has)."""
        if request.pty is None or request.pty.size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "Update needs pty.size (rows, cols)")
        size = request.pty.size
        sb, pid = await self._pid(ctx, request.process)
        await self._call(ctx, lambda s: self.state.procs.resize(s, pid, size.rows, size.cols), "resize a PTY")
        return pb.UpdateResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest],
                           ctx: RequestContext) -> pb.StreamInputResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "process.Process/StreamInput (client streaming) is not "
                                               "supported by agentenv serve over HTTP/1.1; use SendInput "
                                               "(commands.send_stdin)")


def _deadline(ctx: RequestContext) -> float | None:
    ms = ctx.timeout_ms
    return None if ms is None else time.monotonic() + ms / 1000.0


def process_app(state: ServerState, read_max_bytes: int) -> ProcessASGIApplication:
    return ProcessASGIApplication(ProcessService(state), read_max_bytes=read_max_bytes)
