"""E2B's control plane (the sandbox lifecycle calls the SDKs make) on AgentENV sandboxes.

Templates are `agentenv images` names (or local Docker tags): `Sandbox.create("base")` runs image
`base`. Pause checkpoints to disk with CRIU (no memory, no CPU), connect restores, fork copies a sandbox
with its memory. Handlers are plain functions: FastAPI runs them in worker threads, since every
lifecycle call blocks on Docker.
"""

from __future__ import annotations

import math
import time
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Response, Security
from fastapi.security import APIKeyHeader
from pydantic import BaseModel, ConfigDict, Field

from agentenv.checks import MAX_FORKS
from agentenv.errors import AgentEnvError, SandboxNotFound, SandboxStateError
from agentenv.faults import crash_point
from agentenv.sandbox import Sandbox, inherited_labels
from agentenv.server.errors import ApiError
from agentenv.server.metrics import Metrics
from agentenv.server.reaper import NEVER
from agentenv.server.state import API_KEY_HEADER, ServerState, Unauthorized
from agentenv.server.store import E2BRecord

CLIENT_ID = "agentenv"
_MEMORY_KEPT = "a paused sandbox always keeps its memory and processes (a CRIU checkpoint)"
API_KEY = APIKeyHeader(name="X-API-Key", auto_error=False,
                       description="the server's key: $AGENTENV_API_KEY or $AGENTENV_HOME/server-api-key")


# ---- request and response bodies (field names as E2B's OpenAPI spells them) ----------------------
class NewSandbox(BaseModel):
    """POST /sandboxes and /v2/sandboxes. Unknown fields are ignored; E2B features AgentENV does not
    have (internet access, custom networks, MCP, volumes, auto-resume) are refused when asked for."""

    model_config = ConfigDict(extra="allow")
    templateID: str = Field(min_length=1, max_length=256, description="an `agentenv images` name or tag")
    timeout: int | None = Field(None, ge=0, description="time to live in seconds")
    autoPause: bool | None = Field(None, description="pause instead of kill when the TTL runs out")
    autoPauseMemory: bool | None = None
    autoResume: Any = None
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: Any = None
    mcp: Any = None
    volumeMounts: Any = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None


class TimeoutBody(BaseModel):
    timeout: int = Field(ge=0)


class ConnectBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout: int | None = Field(None, ge=0)
    memory: bool | None = None


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout: int | None = Field(None, ge=0)
    autoPause: bool | None = None


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    memory: bool | None = None
    requireHealthyGuest: bool | None = None


class ForkBody(BaseModel):
    timeout: int | None = Field(None, ge=0)
    count: int | None = Field(None, ge=1, le=MAX_FORKS)
    metadata: dict[str, str] | None = Field(None, description="the forks' metadata (default: the source's)")


class RefreshBody(BaseModel):
    duration: int | None = Field(None, ge=0)


class CreatedSandbox(BaseModel):
    templateID: str
    sandboxID: str
    clientID: str
    envdVersion: str
    envdAccessToken: str
    trafficAccessToken: str | None = None
    domain: str | None = None


class Lifecycle(BaseModel):
    autoResume: bool
    onTimeout: Literal["kill", "pause"]


class ListedSandbox(BaseModel):
    templateID: str
    sandboxID: str
    clientID: str
    startedAt: str
    endAt: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: Literal["running", "paused"]
    envdVersion: str
    metadata: dict[str, str]


class SandboxDetail(ListedSandbox):
    envdAccessToken: str
    allowInternetAccess: bool
    lifecycle: Lifecycle


class ForkResult(BaseModel):
    sandbox: CreatedSandbox | None = None
    error: dict[str, Any] | None = None


class SnapshotBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = Field(None, min_length=1, max_length=128)
    memory: bool | None = None


class SnapshotInfo(BaseModel):
    snapshotID: str
    names: list[str]


class MetricSample(BaseModel):
    """One `get_metrics` entry, as E2B's SandboxMetric."""

    timestamp: str
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int


class HostInfo(BaseModel):
    """GET /host: what a client needs to place a new sandbox on the least loaded host."""

    memAvailableBytes: int = Field(description="the host's MemAvailable (/proc/meminfo) less its "
                                               "memory_reserve_mib")
    memTotalBytes: int
    running: int = Field(description="sandboxes served by this API that are running")
    paused: int = Field(description="sandboxes served by this API that are paused (no memory)")


class AgentEnvView(BaseModel):
    """GET /sandboxes/{id}/agentenv: AgentENV's own view of a sandbox (for `agentenv --server`)."""

    sandbox: dict[str, Any] = Field(description="`Sandbox.describe()`: id, state, image, user, parent, ...")
    stats: dict[str, Any] = Field(description="`Sandbox.stats()`: rss_bytes, cpu_seconds, checkpoint_bytes")
    config: dict[str, Any] = Field(description="the sandbox's config (`SandboxConfig.to_dict()`)")
    metadata: dict[str, str] = Field(description="the E2B metadata given at create (the client's labels)")


class ErrorBody(BaseModel):
    code: int
    message: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorBody} for s in (400, 401, 404, 409, 500)}


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (the kernel reports kB)."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    return out


def _when(ts: float) -> datetime:
    """A registry time (seconds since the epoch) as the UTC datetime the API reports."""
    return datetime.fromtimestamp(min(ts, NEVER), UTC)


def _iso(ts: float) -> str:
    return _when(ts).isoformat().replace("+00:00", "Z")


def _cursor(token: str) -> tuple[float, str]:
    """The (start time, sandbox id) key a list page's `x-next-token` names, or a 400 for anything else."""
    when, _, sandbox_id = token.partition("_")
    try:
        key = (float(when), sandbox_id)
    except ValueError:
        key = (math.nan, "")
    if not (math.isfinite(key[0]) and sandbox_id):
        raise ApiError(400, f"invalid nextToken {token!r}: pass the x-next-token of the previous page")
    return key


def api_key_dependency(state: ServerState) -> Callable[..., None]:
    """The dependency every control-plane route declares: the server's API key in X-API-Key, else 401."""

    def api_key(key: str | None = Security(API_KEY)) -> None:
        try:
            state.check_api_key({API_KEY_HEADER: key} if key is not None else {})
        except Unauthorized as e:
            raise ApiError(401, str(e)) from None

    return api_key


def control_router(state: ServerState) -> APIRouter:
    """Every route requires the API key (X-API-Key)."""
    settings = state.settings
    r = APIRouter(dependencies=[Depends(api_key_dependency(state))], responses=_ERRORS, tags=["sandboxes"])

    def ttl(timeout: int | None) -> int:
        t = settings.default_timeout_s if timeout is None else timeout
        if t > settings.max_timeout_s:
            raise ApiError(400, f"timeout {t} s exceeds the server's max_timeout_s={settings.max_timeout_s}")
        return t

    def created(sb: Sandbox, rec: E2BRecord) -> CreatedSandbox:
        return CreatedSandbox(templateID=rec.template_id, sandboxID=sb.id, clientID=CLIENT_ID,
                              envdVersion=settings.envd_version, envdAccessToken=rec.envd_token)

    def listed(sb: Sandbox, rec: E2BRecord, status: str) -> dict[str, Any]:
        cfg = sb.config
        return dict(templateID=rec.template_id, sandboxID=sb.id, clientID=CLIENT_ID,
                    startedAt=_iso(rec.started_at), endAt=_iso(rec.end_at),
                    cpuCount=max(1, math.ceil(cfg.cpus)),
                    memoryMB=cfg.memory_bytes // 2**20, diskSizeMB=0, state=status,
                    envdVersion=settings.envd_version, metadata=rec.metadata)

    def served(sandbox_id: str, *states: str) -> tuple[Sandbox, E2BRecord, str]:
        sb, rec = state.sandbox(sandbox_id, probe=True)  # a dead container: 404 saying why, not a 500
        status = sb.status
        if status == "closed":  # killed (by a client, its TTL) since `state.sandbox` looked
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found (it was killed)")
        if states and status not in states:
            raise SandboxStateError(f"sandbox {sandbox_id} is {status}" +
                                    (f": {sb.reason}" if sb.reason else ""))
        return sb, rec, status

    # ---- create ----------------------------------------------------------------------------------
    def create(body: NewSandbox) -> CreatedSandbox:
        unsupported = [name for name, on in (
            ("allow_internet_access", body.allow_internet_access is True),
            ("network", bool(body.network)), ("mcp", bool(body.mcp)),
            ("volumeMounts", bool(body.volumeMounts)),
            ("autoResume", body.autoResume is True or (isinstance(body.autoResume, dict)
                                                       and bool(body.autoResume.get("enabled")))),
        ) if on]
        if unsupported:
            raise ApiError(400, f"not supported by agentenv serve: {', '.join(unsupported)} (sandboxes have "
                                "no network; paused sandboxes resume on connect)")
        if body.autoPauseMemory is False:
            raise ApiError(400, "autoPauseMemory=false (a filesystem-only pause at the timeout) is not "
                                f"supported by agentenv serve: {_MEMORY_KEPT}")
        timeout = ttl(body.timeout)
        snap = state.store.snapshot(body.templateID)
        template = snap["snapshot_id"] if snap is not None else body.templateID
        metadata, env_vars, auto_pause = body.metadata or {}, body.envVars or {}, bool(body.autoPause)
        labels = state.store.served_labels(template, metadata, env_vars, auto_pause)
        if snap is not None:  # a snapshot: fork its paused sandbox (memory and files)
            source = Sandbox.get(snap["snapshot_id"])
            sb = source.fork(1, labels={**inherited_labels(source.labels), **labels})[0]
        else:
            sb = Sandbox.create(image=body.templateID, labels=labels)
        try:
            rec = state.store.insert(sb.id, template, metadata, env_vars, timeout, auto_pause)
        except BaseException:
            sb.close()
            raise
        return created(sb, rec)

    r.add_api_route("/sandboxes", create, methods=["POST"], status_code=201, response_model=CreatedSandbox,
                    summary="Create a sandbox from a template (an agentenv image)")
    r.add_api_route("/v2/sandboxes", create, methods=["POST"], status_code=201, response_model=CreatedSandbox,
                    summary="Create a sandbox (v2 path of the same call)")

    # ---- list / get ------------------------------------------------------------------------------
    def select(metadata: str | None, states: set[str], template: str | None = None,
               started_after: datetime | None = None) -> list[tuple[tuple[float, str], dict[str, Any]]]:
        """(sort key, listed sandbox) of the served sandboxes that pass the filters, oldest first; the key
        (start time, id) orders them and is what a page's `x-next-token` continues after."""
        want: dict[str, str] = {}
        if metadata:
            try:
                want = dict(urllib.parse.parse_qsl(metadata, keep_blank_values=True, strict_parsing=True))
            except ValueError:
                raise ApiError(400, f"metadata filter {metadata!r} is not key=value&key=value") from None
        if started_after is not None and started_after.tzinfo is None:
            started_after = started_after.replace(tzinfo=UTC)  # a time without a zone is taken as UTC
        out = []
        for sid in state.store.ids():
            try:
                sb, rec = state.sandbox(sid)
            except AgentEnvError:
                continue
            if template is not None and rec.template_id != template:
                continue
            # compared as reported (startedAt, to the microsecond), so a sandbox's own start is "after"
            if started_after is not None and _when(rec.started_at) < started_after:
                continue
            status = sb.status
            if status not in states or any(rec.metadata.get(k) != v for k, v in want.items()):
                continue
            out.append(((rec.started_at, sb.id), listed(sb, rec, status)))
        return sorted(out, key=lambda kv: kv[0])

    @r.get("/v2/sandboxes", response_model=list[ListedSandbox], summary="List sandboxes (paginated)")
    def list_v2(response: Response, metadata: str | None = None,
                state_: str | None = Query(None, alias="state"),
                limit: int | None = Query(None, ge=1, le=1000), nextToken: str | None = None,
                order: Literal["asc", "desc"] = Query(
                    "desc", description="by start time: `desc` (the default, as E2B's) lists the newest "
                            "first"),
                startedAfter: datetime | None = Query(
                    None, description="only sandboxes started at or after this time (ISO 8601)"),
                template: str | None = Query(None, description="only sandboxes of this template id"),
                ) -> list[dict[str, Any]]:
        states = {s.strip() for s in (state_ or "running,paused").split(",") if s.strip()}
        if not states <= {"running", "paused"}:
            raise ApiError(400, f"state must be running and/or paused, got {state_!r}")
        rows = select(metadata, states, template, startedAfter)
        if order == "desc":
            rows.reverse()
        if nextToken:  # the rows after the last one of the previous page (its key), in this order
            after = _cursor(nextToken)
            rows = [kv for kv in rows if (kv[0] < after if order == "desc" else kv[0] > after)]
        size = limit or settings.list_limit
        page = rows[:size]
        if len(rows) > size:
            key = page[-1][0]
            response.headers["x-next-token"] = f"{key[0]!r}_{key[1]}"
        return [row for _key, row in page]

    @r.get("/sandboxes", response_model=list[ListedSandbox], summary="List running sandboxes (v1)")
    def list_v1(metadata: str | None = None) -> list[dict[str, Any]]:
        return [row for _key, row in select(metadata, {"running"})]

    @r.get("/sandboxes/{sandbox_id}", response_model=SandboxDetail, summary="Get a sandbox")
    def get(sandbox_id: str) -> dict[str, Any]:
        sb, rec, status = served(sandbox_id)
        if status not in ("running", "paused"):  # e.g. broken by another request meanwhile: not a 500
            raise SandboxStateError(f"sandbox {sandbox_id} is {status}: {sb.reason or 'unknown reason'}")
        return {**listed(sb, rec, status), "envdAccessToken": rec.envd_token, "allowInternetAccess": False,
                "lifecycle": {"autoResume": False, "onTimeout": "pause" if rec.auto_pause else "kill"}}

    # ---- kill / pause / connect / resume / timeout -----------------------------------------------
    @r.delete("/sandboxes/{sandbox_id}", status_code=204, summary="Kill a sandbox")
    def kill(sandbox_id: str) -> Response:
        sb, _rec = state.sandbox(sandbox_id)
        sb.close()
        state.store.delete(sb.id)
        metrics.forget(sb.id)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/pause", status_code=204,
            summary="Pause: checkpoint to disk (no memory, no CPU); 409 when already paused")
    def pause(sandbox_id: str, body: PauseBody | None = None) -> Response:
        if body is not None and body.memory is False:
            raise ApiError(400, "a filesystem-only pause (pause(mode='filesystem'), keep_memory=False) is "
                                f"not supported by agentenv serve: {_MEMORY_KEPT}; pause with memory, or "
                                "kill the sandbox")
        sb, _rec, status = served(sandbox_id)
        if status == "paused":
            raise SandboxStateError(f"sandbox {sandbox_id} is already paused")
        crash_point("pause-start")
        with state.gone_if_broken(sb):
            sb.pause()
        crash_point("pause-recorded")
        state.store.set_end(sb.id, time.time())
        return Response(status_code=204)

    def connect(sandbox_id: str, response: Response, body: ConnectBody | None = None) -> CreatedSandbox:
        timeout = ttl(body.timeout if body else None)
        if body is not None and body.memory is False:
            raise ApiError(400, "connect with memory=false (a cold boot from the disk state) is not "
                                f"supported by agentenv serve: {_MEMORY_KEPT}, and a resume restores it")
        sb, rec, status = served(sandbox_id, "running", "paused")
        resumed = False
        if status == "paused":
            # its new time to live before it runs: a paused row is expired (its end is its pause), and the
            # reaper would kill a running sandbox it found expired between the resume and a later set_end
            state.store.set_end(sb.id, time.time() + timeout)
            try:
                with state.gone_if_broken(sb):
                    sb.resume()
                resumed = True
                response.status_code = 201
            except SandboxStateError:
                if sb.status != "running":  # another request resumed it meanwhile: fine
                    raise
        end = time.time() + timeout
        if not resumed:  # running: E2B only ever extends its time to live, never cuts it
            now_rec = state.store.get(sb.id) or rec  # as set by whoever resumed it, if someone did
            end = max(end, now_rec.end_at)
        state.store.set_end(sb.id, end)
        return created(sb, rec)

    for path in ("/sandboxes/{sandbox_id}/connect", "/v2/sandboxes/{sandbox_id}/connect"):
        r.add_api_route(path, connect, methods=["POST"], status_code=200, response_model=CreatedSandbox,
                        summary="Connect: resume a paused sandbox (201, TTL `timeout` from now) or extend a "
                                "running one (200; its TTL becomes `timeout` from now if that is later)",
                        responses={201: {"model": CreatedSandbox}})

    @r.post("/sandboxes/{sandbox_id}/resume", status_code=201, response_model=CreatedSandbox, deprecated=True,
            summary="Resume a paused sandbox (deprecated: use connect)")
    def resume(sandbox_id: str, body: ResumeBody | None = None) -> CreatedSandbox:
        timeout = ttl(body.timeout if body else None)
        sb, rec, status = served(sandbox_id, "running", "paused")
        if status == "running":
            raise SandboxStateError(f"sandbox {sandbox_id} is already running")
        state.store.set_end(sb.id, time.time() + timeout)  # before it runs, as connect does
        with state.gone_if_broken(sb):
            sb.resume()
        state.store.set_end(sb.id, time.time() + timeout)
        return created(sb, rec)

    @r.post("/sandboxes/{sandbox_id}/timeout", status_code=204,
            summary="Set the time to live from now (at expiry: pause with autoPause, else kill)")
    def set_timeout(sandbox_id: str, body: TimeoutBody) -> Response:
        timeout = ttl(body.timeout)
        sb, _rec, _status = served(sandbox_id, "running")
        state.store.set_end(sb.id, time.time() + timeout)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/refreshes", status_code=204, summary="Extend the time to live")
    def refresh(sandbox_id: str, body: RefreshBody | None = None) -> Response:
        timeout = ttl(body.duration if body and body.duration is not None else None)
        sb, rec, _status = served(sandbox_id, "running")
        state.store.set_end(sb.id, max(rec.end_at, time.time() + timeout))
        return Response(status_code=204)

    # ---- fork (k3rl extension, E2B's fork call) --------------------------------------------------
    @r.post("/sandboxes/{sandbox_id}/fork", status_code=201, response_model=list[ForkResult],
            response_model_exclude_none=True,
            summary="Fork: new running sandboxes restored from this one's memory and files")
    def fork(sandbox_id: str, body: ForkBody | None = None) -> list[ForkResult]:
        body = body or ForkBody()
        timeout = ttl(body.timeout)
        sb, rec, _status = served(sandbox_id, "running", "paused")
        out = []
        metadata = rec.metadata if body.metadata is None else body.metadata
        labels = {**inherited_labels(sb.labels),
                  **state.store.served_labels(rec.template_id, metadata, rec.env_vars, rec.auto_pause)}
        for child in sb.fork(body.count or 1, labels=labels):
            crec = state.store.insert(child.id, rec.template_id, metadata, rec.env_vars, timeout,
                                      rec.auto_pause)
            out.append(ForkResult(sandbox=created(child, crec)))
        return out

    # ---- metrics ---------------------------------------------------------------------------------
    metrics = Metrics()

    @r.get("/sandboxes/{sandbox_id}/metrics", response_model=list[MetricSample],
           summary="Resource use now (cgroup and work dir), when now is within [start, end]: one sample, no "
                   "history is kept")
    def get_metrics(sandbox_id: str, start: int | None = Query(None, description="Unix time, seconds"),
                    end: int | None = Query(None, description="Unix time, seconds")) -> list[dict[str, Any]]:
        sb, rec, _status = served(sandbox_id, "running", "paused")
        sample = metrics.sample(sb, rec.started_at)
        lo = rec.started_at if start is None else start
        hi = sample.when if end is None else end + 1  # the query is to the second
        return [sample.to_json()] if math.floor(lo) <= sample.when <= hi else []

    # ---- AgentENV extensions: placement and the CLI's view ---------------------------------------
    @r.get("/host", response_model=HostInfo,
           summary="This host's free memory (MemAvailable) and sandbox counts, for placing new sandboxes")
    def host() -> HostInfo:
        counts = {"running": 0, "paused": 0}
        for sid in state.store.ids():
            try:
                status = state.sandbox(sid)[0].status
            except AgentEnvError:
                continue
            if status in counts:
                counts[status] += 1
        mem = _meminfo()
        free = max(0, mem.get("MemAvailable", 0) - settings.memory_reserve_mib * 2**20)
        return HostInfo(memAvailableBytes=free, memTotalBytes=mem.get("MemTotal", 0), **counts)

    @r.get("/sandboxes/{sandbox_id}/agentenv", response_model=AgentEnvView,
           summary="AgentENV's view of a sandbox: describe() and stats() (state, user, RSS, checkpoint size)")
    def agentenv_view(sandbox_id: str) -> AgentEnvView:
        sb, rec = state.sandbox(sandbox_id)
        return AgentEnvView(sandbox=sb.describe(), stats=sb.stats().to_dict(), config=sb.config.to_dict(),
                            metadata=rec.metadata)

    # ---- snapshots: a paused fork that new sandboxes fork from ----------------------------------
    @r.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotInfo,
            summary="Snapshot memory and files into a template (the sandbox keeps running)")
    def create_snapshot(sandbox_id: str, body: SnapshotBody | None = None) -> SnapshotInfo:
        body = body or SnapshotBody()
        if body.memory is False:
            raise ApiError(400, "filesystem-only snapshots are not supported by agentenv serve: snapshots "
                                "always hold memory and files (CRIU)")
        sb, rec, _status = served(sandbox_id, "running", "paused")
        labels = {**inherited_labels(sb.labels),
                  **state.store.snapshot_labels(sb.id, body.name, rec.template_id)}
        snap = sb.fork(1, labels=labels)[0]
        try:
            snap.pause()
            old = state.store.snapshot(body.name) if body.name else None
            if old is not None and old["name"] == body.name:  # the name moves to the new snapshot
                Sandbox.get(old["snapshot_id"]).close()
                state.store.delete_snapshot(old["snapshot_id"])
            state.store.insert_snapshot(snap.id, sb.id, body.name, rec.template_id)
        except BaseException:
            snap.close()
            raise
        return SnapshotInfo(snapshotID=snap.id, names=[body.name] if body.name else [])

    @r.get("/snapshots", response_model=list[SnapshotInfo], summary="List snapshots")
    def list_snapshots(response: Response, sandboxID: str | None = None, name: str | None = None,
                       limit: int | None = Query(None, ge=1, le=1000),
                       nextToken: str | None = None) -> list[SnapshotInfo]:
        rows = state.store.snapshots(sandboxID, name)
        try:
            start = int(nextToken) if nextToken else 0
        except ValueError:
            raise ApiError(400, f"invalid nextToken {nextToken!r}") from None
        size = limit or settings.list_limit
        if start + size < len(rows):
            response.headers["x-next-token"] = str(start + size)
        return [SnapshotInfo(snapshotID=s["snapshot_id"], names=[s["name"]] if s["name"] else [])
                for s in rows[start:start + size]]

    @r.delete("/templates/{template_id}", status_code=204,
              summary="Delete a snapshot (templates that are images are managed with `agentenv images`)")
    def delete_snapshot(template_id: str) -> Response:
        snap = state.store.snapshot(template_id)
        if snap is None:
            raise ApiError(404, f"no snapshot {template_id!r} (image templates are not deleted through the "
                                "API)")
        Sandbox.get(snap["snapshot_id"]).close()
        state.store.delete_snapshot(snap["snapshot_id"])
        return Response(status_code=204)

    return r
