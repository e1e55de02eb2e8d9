"""Sandboxes on other machines: the client of `agentenv serve` (E2B's control plane + envd's data plane).

`SandboxHost(url)` is one server; `RemoteSandbox` is a `SandboxHandle` (agentenv.api) on one of its
sandboxes, with the results, argument checks and error types of a local `Sandbox`; `SandboxHosts([url,
...])` places new sandboxes on the host with the most free memory (`GET /host`) and remembers which host
holds which sandbox.

    from agentenv.remote import SandboxHost
    sb = SandboxHost("http://10.0.0.5:3000").create(image="base")   # key: $AGENTENV_API_KEY
    sb.exec("echo hi").stdout; sb.pause(); sb.resume(); forks = sb.fork(4)

Every request has a timeout (conf/agentenv/remote.yaml) and a bounded number of attempts: a request
that cannot reach the host is retried, one that may have reached it is retried only when it changes
nothing (GET); the waits between attempts are exponential, jittered and capped (`agentenv.backoff`).
Errors are the AgentENV types the server names (`agentenv.errors.ERROR_TABLE`), carrying its message
prefixed by the host; a host that does not answer is `HostUnavailable`. Commands run through envd's
`process.Process/Start` with the generated Connect client shipped in `e2b` (`agentenv.remote_rpc`), files
through `/files`.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from agentenv import checks
from agentenv.backoff import retry_delay
from agentenv.config import SandboxConfig
from agentenv.errors import (
    ERROR_HEADER,
    AgentEnvError,
    CheckpointError,
    ConfigError,
    ExecTimeout,
    HostUnavailable,
    SandboxNotFound,
    SandboxStateError,
    SessionError,
)
from agentenv.paths import API_KEY_ENV, SERVER_ENV
from agentenv.remote_rpc import EnvdClient, status_error, unreachable
from agentenv.remote_rpc import connect_error as _connect_error  # noqa: F401  (the RPC half of `_error`)
from agentenv.results import ExecResult, SandboxStats
from agentenv.settings import build, load_settings, setting

__all__ = ["HostUnavailable", "RemoteSandbox", "RemoteSession", "RemoteSettings", "SandboxHost",
           "SandboxHosts", "shared_host", "shared_hosts"]

T = TypeVar("T")
_STDIN_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class RemoteSettings:
    """Timeouts and retries of the client; see conf/agentenv/remote.yaml for each field."""

    connect_timeout_s: float = setting(above=0)
    request_timeout_s: float = setting(above=0)
    lifecycle_timeout_s: float = setting(above=0)
    exec_slack_s: float = setting(min=0)
    retries: int = setting(min=1)
    retry_backoff_s: float = setting(min=0)
    retry_backoff_max_s: float = setting(min=0)
    sandbox_ttl_s: int = setting(above=0)
    placement_tolerance_mib: int = setting(min=0)

    @classmethod
    def load(cls, path: str | Path | None = None) -> RemoteSettings:
        """Values from `path` (default: `$AGENTENV_REMOTE_CONFIG`, else conf/agentenv/remote.yaml)."""
        return load_settings(cls, "remote client config", path, env_var="AGENTENV_REMOTE_CONFIG",
                             file_name="remote.yaml")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RemoteSettings:
        return build(cls, data, "remote client config")


def _error(resp: httpx.Response, host: str, on_500: type[AgentEnvError]) -> AgentEnvError:
    """The AgentENV error for an HTTP error answer of `agentenv serve` (`agentenv.errors.ERROR_TABLE`:
    the type the server named, else the most general one of the status)."""
    return status_error(f"{host}: {_message(resp)}", resp.status_code, resp.headers.get(ERROR_HEADER), on_500)


class SandboxHost:
    """One `agentenv serve` (its URL and API key): create, find and list its sandboxes."""

    def __init__(self, url: str | None = None, api_key: str | None = None,
                 settings: RemoteSettings | None = None, rng: random.Random | None = None) -> None:
        """`rng`: the random source of the retry delays' jitter (`agentenv.backoff`; default: a new one)."""
        url = url or os.environ.get(SERVER_ENV)
        if not url or not url.startswith(("http://", "https://")):
            raise ConfigError(f"sandbox host URL must start with http:// or https://, got {url!r} "
                              f"(give --server URL or set ${SERVER_ENV})")
        key = api_key or os.environ.get(API_KEY_ENV)
        if not key:
            raise ConfigError(f"no API key for sandbox host {url}: set ${API_KEY_ENV} (the key the host's "
                              "`agentenv serve` uses) or pass api_key=")
        self.url = url.rstrip("/")
        self.api_key = key
        self.settings = settings or RemoteSettings.load()
        self._rng = rng or random.Random()
        s = self.settings
        self._http = httpx.Client(base_url=self.url, headers={"X-API-Key": key},
                                  timeout=httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s))
        self.envd = EnvdClient(self.url, key, s, self._rng)  # the RPC routes (envd's Connect services)

    def __repr__(self) -> str:
        return f"SandboxHost({self.url!r})"

    def close(self) -> None:
        self._http.close()
        self.envd.close()

    # ---- transport ---------------------------------------------------------------------------
    def request(self, method: str, path: str, *, timeout: float | None = None,
                on_500: type[AgentEnvError] = AgentEnvError, ok: Sequence[int] = (),
                **kw: Any) -> httpx.Response:
        """One HTTP call with bounded attempts; a non-2xx status (other than `ok`) raises the typed error."""
        t = self.settings.request_timeout_s if timeout is None else timeout
        safe = method in ("GET", "HEAD")
        for attempt in range(1, self.settings.retries + 1):
            try:
                resp = self._http.request(method, path, timeout=httpx.Timeout(
                    t, connect=self.settings.connect_timeout_s), **kw)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.TransportError) as e:
                never_sent = isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)
                if attempt < self.settings.retries and (never_sent or safe):
                    time.sleep(retry_delay(attempt, self.settings.retry_backoff_s,
                                           self.settings.retry_backoff_max_s, self._rng))
                    continue
                raise unreachable(self.url, e, attempt) from None
            if resp.status_code < 400 or resp.status_code in ok:
                return resp
            raise _error(resp, self.url, on_500)
        raise AssertionError("unreachable")

    def rpc_stream(self, sandbox: RemoteSandbox, call: Callable[..., Iterator[T]], message: Any,
                   timeout_s: float) -> Iterator[T]:
        """A server stream of envd's generated client on `sandbox` (`call`: a method of `self.envd.process`,
        e.g. `start`): the messages; the host's `deadline_exceeded` at `timeout_s` is raised as
        TimeoutError, its other errors as the typed error (`EnvdClient.stream`)."""
        return self.envd.stream(call, message, sandbox._envd_headers(), timeout_s)

    def rpc_unary(self, sandbox: RemoteSandbox, call: Callable[..., T], message: Any) -> T:
        """A unary call of envd's generated client on `sandbox` (`EnvdClient.unary`)."""
        return self.envd.unary(call, message, sandbox._envd_headers())

    # ---- sandboxes ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """`GET /host`: memAvailableBytes, memTotalBytes, running, paused."""
        return self.request("GET", "/host").json()

    def create(self, image: str | None = None, memory: str | None = None, cpus: float | None = None,
               config: SandboxConfig | Mapping[str, Any] | None = None,
               labels: Mapping[str, str] | None = None) -> RemoteSandbox:
        """A new running sandbox on this host. Its image is `image` (else `config`'s, else this machine's
        default config's); memory, CPUs and every other limit are the host's own sandbox config
        (conf/sandbox/default.yaml there), so `memory`/`cpus` are refused."""
        given = checks.sandbox_labels(labels) or {}
        if memory is not None or cpus is not None:
            raise ConfigError("memory and cpus of a remote sandbox are set by its host's sandbox config "
                              "(conf/sandbox/default.yaml on the host), not by the client")
        if isinstance(config, Mapping):
            config = SandboxConfig.from_dict(dict(config))
        template = image or (config or SandboxConfig.load()).image
        body = {"templateID": template, "timeout": self.settings.sandbox_ttl_s,
                "metadata": given}
        data = self.request("POST", "/sandboxes", json=body, timeout=self.settings.lifecycle_timeout_s).json()
        return RemoteSandbox(self, data["sandboxID"], data["envdAccessToken"])

    def get(self, sandbox_id: str) -> RemoteSandbox:
        """The sandbox with this id, or the only one whose id starts with it."""
        if not isinstance(sandbox_id, str) or not sandbox_id.strip():
            raise SandboxNotFound(f"give a sandbox id (`agentenv --server {self.url} ls` lists them)")
        try:
            data = self.request("GET", f"/sandboxes/{sandbox_id}").json()
        except SandboxNotFound:
            ids = [s["sandboxID"] for s in self._listed() if s["sandboxID"].startswith(sandbox_id)]
            if len(ids) != 1:
                raise SandboxNotFound(
                    f"{self.url}: " + (f"no sandbox {sandbox_id!r}" if not ids else f"sandbox id prefix "
                                       f"{sandbox_id!r} is ambiguous ({', '.join(ids[:5])})")) from None
            data = self.request("GET", f"/sandboxes/{ids[0]}").json()
        return RemoteSandbox(self, data["sandboxID"], data["envdAccessToken"])

    def _listed(self) -> list[dict[str, Any]]:
        rows, token = [], None
        for _ in range(10_000):  # pages of list_limit; bounded
            resp = self.request("GET", "/v2/sandboxes", params={"limit": 1000, "order": "asc", **(
                {"nextToken": token} if token else {})})  # oldest first, as the local registry lists
            rows += resp.json()
            token = resp.headers.get("x-next-token")
            if not token:
                break
        return rows

    def list(self, include_closed: bool = False) -> list[RemoteSandbox]:
        """Running and paused sandboxes of this host (a closed one is forgotten by the server, so
        `include_closed` adds nothing)."""
        return [self.get(s["sandboxID"]) for s in self._listed()]


class RemoteSandbox:
    """A handle on one sandbox of a `SandboxHost` (the methods tasks and the CLI call on `Sandbox`)."""

    def __init__(self, host: SandboxHost, sandbox_id: str, envd_token: str) -> None:
        self.host = host
        self._id = sandbox_id
        self._token = envd_token
        self._view: dict[str, Any] | None = None
        self._config: SandboxConfig | None = None
        self._refreshed = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False  # closed through this handle: later calls are refused as on a local one

    # ---- finding and creating (on $AGENTENV_SERVER unless `server=` says) ----------------------
    @classmethod
    def create(cls, image: str | None = None, memory: str | None = None, cpus: float | None = None,
               config: SandboxConfig | None = None, labels: Mapping[str, str] | None = None, *,
               server: str | None = None, api_key: str | None = None) -> RemoteSandbox:
        return shared_host(server, api_key).create(image, memory, cpus, config, labels)

    @classmethod
    def get(cls, sandbox_id: str, *, server: str | None = None, api_key: str | None = None) -> RemoteSandbox:
        return shared_host(server, api_key).get(sandbox_id)

    @classmethod
    def list(cls, include_closed: bool = False, *, server: str | None = None,
             api_key: str | None = None) -> list[RemoteSandbox]:
        return shared_host(server, api_key).list(include_closed)

    # ---- properties --------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self._id

    def __repr__(self) -> str:
        return f"RemoteSandbox(id={self._id!r}, host={self.host.url!r})"

    def _envd_headers(self) -> dict[str, str]:
        return {"E2b-Sandbox-Id": self._id, "X-Access-Token": self._token}

    def _agentenv_view(self) -> dict[str, Any]:
        return self.host.request("GET", f"/sandboxes/{self._id}/agentenv").json()

    @property
    def status(self) -> str:
        """'running' | 'paused' | 'closed' (the host forgot it) | 'broken' (the host says why)."""
        try:
            resp = self.host.request("GET", f"/sandboxes/{self._id}", ok=(500,))
        except SandboxNotFound:
            return "closed"
        return "broken" if resp.status_code == 500 else resp.json()["state"]

    @property
    def reason(self) -> str | None:
        return self.describe().get("reason")

    @property
    def config(self) -> SandboxConfig:
        """The sandbox's config on its host (fixed at creation; fetched once per handle)."""
        if self._config is None:
            self._config = SandboxConfig.from_dict(self._agentenv_view()["config"])
        return self._config

    @property
    def image(self) -> str:
        return self.describe()["image"]

    @property
    def user(self) -> str:
        return self.describe()["user"]

    @property
    def parent_id(self) -> str | None:
        return self.describe()["parent"]

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.describe()["labels"])

    def describe(self) -> dict[str, Any]:
        """`Sandbox.describe()` as the host reports it (the labels given at create included), plus the
        host's URL."""
        view = self._agentenv_view()
        d = view["sandbox"]
        return {**d, "labels": {**d["labels"], **view["metadata"]}, "host": self.host.url}

    def stats(self) -> SandboxStats:
        return SandboxStats(**self._agentenv_view()["stats"])

    # ---- commands ----------------------------------------------------------------------------
    def exec(self, cmd: str | Sequence[str], timeout: float | None = None, stdin: bytes | str | None = None,
             env: Mapping[str, str] | None = None, workdir: str | None = None,
             raise_on_timeout: bool = False) -> ExecResult:
        """`Sandbox.exec` on the host: a string runs under `sh -c`, a list as argv; at `timeout` (default:
        the sandbox's exec_timeout_s) the host kills the command (exit code 124, `timed_out`)."""
        argv = checks.command_argv(cmd)
        data = checks.stdin_bytes(stdin)
        env = checks.exec_env(env)
        workdir = checks.exec_workdir(workdir)
        checks.timeout_seconds(timeout, 1.0)  # refused before the config is fetched
        self._require_open("exec in")
        cfg = self.config
        limit = cfg.output_limit_bytes
        timeout_s = checks.timeout_seconds(timeout, cfg.exec_timeout_s)
        self._keep_alive()
        req = pb.StartRequest(process=pb.ProcessConfig(cmd=argv[0], args=argv[1:], envs=env or {},
                                                       cwd=workdir or cfg.workspace),  # as locally
                              stdin=data is not None)
        out, err, code, timed_out = bytearray(), bytearray(), None, False
        started = time.perf_counter()
        events = self.host.rpc_stream(self, self.host.envd.process.start, req, timeout_s)
        try:
            for msg in events:
                ev = msg.event.event if msg.event is not None else None
                if ev is None:
                    continue
                if ev.field == "start" and data is not None:
                    self._send_stdin(ev.value.pid, data)
                elif ev.field == "data" and ev.value.output is not None:
                    buf = out if ev.value.output.field == "stdout" else err
                    buf.extend(ev.value.output.value[:max(0, limit + 1 - len(buf))])  # memory bounded
                elif ev.field == "end":
                    code = ev.value.exit_code
        except TimeoutError:
            timed_out, code = True, 124
        finally:
            events.close()
        if code is None:
            raise HostUnavailable(f"sandbox host {self.host.url}: the command's stream ended without its "
                                  "exit code")
        result = ExecResult(exit_code=code, stdout=bytes(out[:limit]).decode(errors="replace"),
                            stderr=bytes(err[:limit]).decode(errors="replace"),
                            duration_s=time.perf_counter() - started, timed_out=timed_out,
                            truncated=len(out) > limit or len(err) > limit)
        if timed_out and raise_on_timeout:
            raise ExecTimeout(f"command timed out after {timeout_s:g} s in sandbox {self._id}: {cmd!r}",
                              result)
        return result

    def _send_stdin(self, pid: int, data: bytes) -> None:
        sel = pb.ProcessSelector(selector=Oneof("pid", pid))
        for i in range(0, len(data), _STDIN_CHUNK):
            chunk = data[i:i + _STDIN_CHUNK]
            self.host.rpc_unary(self, self.host.envd.process.send_input, pb.SendInputRequest(
                process=sel, input=pb.ProcessInput(input=Oneof("stdin", chunk))))
        self.host.rpc_unary(self, self.host.envd.process.close_stdin, pb.CloseStdinRequest(process=sel))

    def _keep_alive(self) -> None:
        """Extend the host's time to live while commands run (at most every third of it)."""
        ttl = self.host.settings.sandbox_ttl_s
        with self._lock:
            if time.monotonic() - self._refreshed < ttl / 3:
                return
            self._refreshed = time.monotonic()
        self.host.request("POST", f"/sandboxes/{self._id}/refreshes", json={"duration": ttl})

    def session(self) -> RemoteSession:
        """A `ShellSession` whose `run` is one remote exec (no shell state carries between commands, as in a
        local session)."""
        return RemoteSession(self)

    # ---- files -------------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file below the work dir (parents created); paths leading out of it are refused."""
        self._require_open("write files in")
        cfg = self.config
        full = checks.workspace_path(path, cfg.workspace)
        payload = checks.file_payload(data, cfg.file_limit_bytes)
        mode = checks.file_mode(mode)
        self.host.request("POST", "/files", params={"path": full}, content=payload,
                          headers={**self._envd_headers(), "Content-Type": "application/octet-stream"})
        if mode != 0o644:
            r = self.exec(["chmod", format(mode, "o"), "--", full])
            if r.exit_code != 0:
                raise AgentEnvError(f"chmod {format(mode, 'o')} {path} failed: {r.stderr.strip()}")

    def read_file(self, path: str) -> bytes:
        """A file below the work dir; `FileNotFoundInSandbox` (a FileNotFoundError) when there is none."""
        self._require_open("read files from")
        full = checks.workspace_path(path, self.config.workspace)
        return self.host.request("GET", "/files", params={"path": full}, headers=self._envd_headers()).content

    # ---- lifecycle ---------------------------------------------------------------------------
    def _require_open(self, action: str) -> None:
        if self._closed:
            raise SandboxStateError(f"sandbox {self._id} is closed; create a new one (cannot {action} it)")

    def _lifecycle(self, method: str, action: str, **kw: Any) -> httpx.Response:
        """A control-plane call on this sandbox that does Docker/CRIU work (the long timeout)."""
        path = f"/sandboxes/{self._id}" + (f"/{action}" if action else "")
        return self.host.request(method, path, timeout=self.host.settings.lifecycle_timeout_s,
                                 on_500=CheckpointError, **kw)

    def pause(self) -> None:
        """Checkpoint on the host (no memory, no CPU until `resume`)."""
        self._require_open("pause")
        self._lifecycle("POST", "pause")

    def resume(self) -> None:
        """Restore a paused sandbox (SandboxStateError when it is running); its time to live starts anew."""
        self._require_open("resume")
        self._lifecycle("POST", "resume", json={"timeout": self.host.settings.sandbox_ttl_s})
        self._refreshed = time.monotonic()

    def fork(self, n: int, labels: Mapping[str, str] | None = None) -> list[RemoteSandbox]:
        """`n` new running sandboxes on the same host, restored from this one's memory and files.
        `labels`: the forks' labels (default: the source's)."""
        n = checks.fork_count(n)
        given = checks.sandbox_labels(labels)
        self._require_open("fork")
        body: dict[str, Any] = {"count": n, "timeout": self.host.settings.sandbox_ttl_s}
        if given is not None:
            body["metadata"] = given
        rows = self._lifecycle("POST", "fork", json=body).json()
        forks = [RemoteSandbox(self.host, r["sandbox"]["sandboxID"], r["sandbox"]["envdAccessToken"])
                 for r in rows if r.get("sandbox")]
        errors = [str((r.get("error") or {}).get("message", r.get("error")))
                  for r in rows if not r.get("sandbox")]
        if errors:
            for f in forks:
                f.close()
            raise CheckpointError(f"{self.host.url}: fork of {self._id} failed: {'; '.join(errors)}")
        return forks

    def move(self, to: str | SandboxHost, timeout: int | None = None) -> RemoteSandbox:
        """Move this paused sandbox to another `agentenv serve` host, which resumes it there (time to live
        `timeout`, default `sandbox_ttl_s`); its host keeps it until then (docs/agentenv.md, "Moving a paused
        sandbox"). This handle follows it; returns it."""
        self._require_open("move")
        dest = to if isinstance(to, SandboxHost) else SandboxHost(to, self.host.api_key, self.host.settings)
        ttl = timeout or self.host.settings.sandbox_ttl_s
        body = {"to": dest.url, "timeout": ttl, "apiKey": dest.api_key}
        answer = self._lifecycle("POST", "agentenv/move", json=body).json()
        token = answer.get("envdAccessToken") or dest.get(self._id)._token  # "" when decided after a retry
        with self._lock:
            self.host, self._token, self._view = dest, token, None
            self._refreshed = time.monotonic()
        return self

    def close(self) -> None:
        """Remove the sandbox on its host (a sandbox the host no longer has is already closed)."""
        try:
            self._lifecycle("DELETE", "")
        except SandboxNotFound:
            pass
        self._closed = True


class RemoteSession:
    """A `ShellSession` over a remote sandbox: each `run` is one `RemoteSandbox.exec` (as in a local
    session, no shell state carries between commands; `reopened` stays False)."""

    def __init__(self, sandbox: RemoteSandbox) -> None:
        self.sandbox = sandbox
        self.reopened = False
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, cmd: str | Sequence[str], timeout: float | None = None,
            stdin: bytes | str | None = None) -> ExecResult:
        checks.command_argv(cmd)
        checks.timeout_seconds(timeout, 1.0)
        checks.stdin_bytes(stdin)
        if self._closed:
            raise SessionError(f"this session of sandbox {self.sandbox.id} is closed; open a new one with "
                               "sandbox.session()")
        return self.sandbox.exec(cmd, timeout=timeout, stdin=stdin)

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SandboxHosts:
    """Several sandbox hosts: `create` places a sandbox on the one with the most MemAvailable (hosts
    that do not answer are skipped), `get` finds a sandbox on the host that holds it.

    Hosts whose MemAvailable is within ``placement_tolerance_mib`` of the most free count as tied; of
    those, the one with the fewest sandboxes wins (running there, plus this client's creates still in
    flight to it), so equal hosts fill evenly even when many creates start at once (MemAvailable only
    drops once a sandbox has started)."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None,
                 settings: RemoteSettings | None = None) -> None:
        if isinstance(urls, str) or not urls:
            raise ConfigError(f"sandbox hosts must be a non-empty list of URLs, got {urls!r}")
        self.settings = settings or RemoteSettings.load()
        self.hosts = [SandboxHost(u, api_key, self.settings) for u in urls]
        self._where: dict[str, SandboxHost] = {}
        self._placing = [0] * len(self.hosts)  # creates in flight per host (index in self.hosts)
        self._lock = threading.Lock()

    def pick(self) -> SandboxHost:
        """The host a new sandbox goes to now (see the class docstring)."""
        return self.hosts[self._choose(reserve=False)]

    def _choose(self, reserve: bool) -> int:
        answers, failures = [], []
        for i, host in enumerate(self.hosts):
            try:
                info = host.info()
                answers.append((i, int(info["memAvailableBytes"]), int(info.get("running", 0))))
            except AgentEnvError as e:
                failures.append(str(e))
        if not answers:
            raise HostUnavailable("no sandbox host answered: " + "; ".join(failures))
        floor = max(mem for _, mem, _ in answers) - self.settings.placement_tolerance_mib * 2**20
        with self._lock:
            _load, best = min((running + self._placing[i], i) for i, mem, running in answers if mem >= floor)
            if reserve:
                self._placing[best] += 1
        return best

    def create(self, **kwargs: Any) -> RemoteSandbox:
        """`SandboxHost.create(**kwargs)` on the host `pick()` chooses."""
        i = self._choose(reserve=True)
        try:
            sb = self.hosts[i].create(**kwargs)
        finally:
            with self._lock:
                self._placing[i] -= 1
        self._where[sb.id] = sb.host
        return sb

    def host_of(self, sandbox_id: str) -> SandboxHost:
        """The host holding this sandbox (remembered from `create`, else asked of every host)."""
        if sandbox_id in self._where:
            return self._where[sandbox_id]
        for host in self.hosts:
            try:
                host.request("GET", f"/sandboxes/{sandbox_id}", ok=(500,))
            except (SandboxNotFound, HostUnavailable):
                continue
            self._where[sandbox_id] = host
            return host
        raise SandboxNotFound(f"no sandbox host holds sandbox {sandbox_id!r}")

    def get(self, sandbox_id: str) -> RemoteSandbox:
        return self.host_of(sandbox_id).get(sandbox_id)

    def resume(self, sb: RemoteSandbox) -> RemoteSandbox:
        """Resume the paused `sb` where there is room for it (MemAvailable at least its memory limit): on
        its own host when that has room or cannot be judged, else moved to the answering host with the most
        room (the move resumes it; `sb` follows it), else on its own host anyway. Returns `sb`."""
        need = sb.config.memory_bytes
        room: dict[str, int] = {}
        for host in self.hosts:
            try:
                room[host.url] = int(host.info()["memAvailableBytes"])
            except AgentEnvError:
                continue
        if room.get(sb.host.url, need) < need:
            best = max((url for url in room if url != sb.host.url), key=room.__getitem__, default=None)
            if best is not None and room[best] >= need:
                sb.move(next(h for h in self.hosts if h.url == best))
                self._where[sb.id] = sb.host
                return sb
        sb.resume()
        return sb


_shared: dict[tuple[str, ...], SandboxHosts] = {}
_shared_hosts: dict[tuple[str | None, str | None], SandboxHost] = {}
_shared_lock = threading.Lock()


def shared_host(url: str | None = None, api_key: str | None = None) -> SandboxHost:
    """One `SandboxHost` (one connection pool) per URL and key per process, for `RemoteSandbox.create/
    get/list` (`url` None: `$AGENTENV_SERVER`; `api_key` None: `$AGENTENV_API_KEY`)."""
    key = (url or os.environ.get(SERVER_ENV), api_key or os.environ.get(API_KEY_ENV))
    with _shared_lock:
        if key not in _shared_hosts:
            _shared_hosts[key] = SandboxHost(*key)
        return _shared_hosts[key]


def shared_hosts(urls: Sequence[str]) -> SandboxHosts:
    """One `SandboxHosts` per list of URLs per process (tasks of one worker share placement memory)."""
    key = tuple(urls) if not isinstance(urls, str) else (urls,)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = SandboxHosts(list(key))
        return _shared[key]


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:300]}"
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return f"HTTP {resp.status_code}: {str(body)[:300]}"
