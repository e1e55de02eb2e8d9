"""`agentenv.remote_rpc`: envd's RPCs of the remote client through the generated Connect client. Its errors
become the types of `agentenv.errors.ERROR_TABLE` as the server sends them, the host is asked to stop a
stream at the command's timeout (not at the client's limit, `exec_slack_s` later), a unary call that
never reached the host is retried and a stream is not, and an RPC route's answer that is not the Connect
service's (the server's body limit) reads as on the HTTP routes."""

from __future__ import annotations

import dataclasses
import random
import re
import socket
import time
from pathlib import Path

import pytest
from e2b.envd.process import process_pb as pb
from netns_hosts import loopback_server
from protobuf import Oneof

from agentenv.errors import ERROR_TABLE, AgentEnvError, HostUnavailable, ProcessNotFound
from agentenv.remote import RemoteSandbox, RemoteSettings, SandboxHost, _connect_error
from agentenv.server.errors import to_connect

HOST = "http://host:3000"


@pytest.mark.parametrize("row", ERROR_TABLE, ids=lambda r: r.name)
def test_the_connect_errors_the_generated_client_raises_become_the_table_types(row):
    got = _connect_error(to_connect(row.type("what went wrong")), HOST)
    assert type(got) is row.type and str(got) == f"{HOST}: what went wrong"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_unary_call_retries_a_host_it_cannot_reach_and_a_stream_does_not():
    settings = dataclasses.replace(RemoteSettings.load(), retries=3, retry_backoff_s=0.001,
                                   retry_backoff_max_s=0.002)
    rng = random.Random(5)
    host = SandboxHost(f"http://127.0.0.1:{_closed_port()}", "key", settings, rng=rng)
    sb = RemoteSandbox(host, "no-such-sandbox", "token")
    try:
        with pytest.raises(HostUnavailable, match=r"ConnectionError.*after 3 attempt"):
            host.rpc_unary(sb, host.envd.process.close_stdin, pb.CloseStdinRequest())
        replay = random.Random(5)
        replay.random(), replay.random()  # one draw per wait: 3 attempts, 2 waits
        assert rng.random() == replay.random()
        with pytest.raises(HostUnavailable, match=r"after 1 attempt"):
            list(host.rpc_stream(sb, host.envd.process.start, pb.StartRequest(), 5.0))
        assert rng.random() == replay.random()  # no wait drawn for the stream
    finally:
        host.close()


@pytest.mark.docker
def test_envd_calls_of_the_generated_client_against_the_server(server):
    settings = dataclasses.replace(RemoteSettings.load(), exec_slack_s=20.0)
    host = SandboxHost(server.url, server.api_key, settings)
    sb = host.create(image="base")
    try:
        req = pb.StartRequest(process=pb.ProcessConfig(cmd="sh", args=["-c", "echo hi; sleep 30"]))
        started, events = time.monotonic(), []
        with pytest.raises(TimeoutError):  # the host stops it at the timeout, not 20 s later
            for msg in host.rpc_stream(sb, host.envd.process.start, req, 1.0):
                events.append(msg.event.event.field)
        assert time.monotonic() - started < 10 and events[:2] == ["start", "data"]

        gone = pb.ProcessSelector(selector=Oneof("pid", 999_999))
        with pytest.raises(ProcessNotFound, match=server.url):  # the type the server names in the details
            host.rpc_unary(sb, host.envd.process.send_signal,
                           pb.SendSignalRequest(process=gone, signal=pb.Signal.SIGTERM))
        stranger = RemoteSandbox(host, sb.id, "not-the-token")
        with pytest.raises(AgentEnvError, match="token"):
            host.rpc_unary(stranger, host.envd.process.list, pb.ListRequest())
    finally:
        sb.close()
        host.close()


@pytest.mark.docker
def test_the_body_limit_on_an_rpc_route_reads_as_on_the_http_routes(tmp_path):
    defaults = (Path(__file__).parents[2] / "conf" / "agentenv" / "server.yaml").read_text()
    config = tmp_path / "server.yaml"
    config.write_text(re.sub(r"(?m)^max_body_bytes:.*$", "max_body_bytes: 65536", defaults))
    with loopback_server(tmp_path / "home", {"AGENTENV_SERVER_CONFIG": str(config)}) as srv:
        host = SandboxHost(srv.url, srv.api_key)
        sb = host.create(image="base")
        try:
            # SendInput's body is over the limit: the server's 413, not a Connect error; its numeric code
            # must not read as Connect's `unavailable` (BackendUnavailable)
            with pytest.raises(AgentEnvError, match="max_body_bytes=65536") as e:
                sb.exec("cat", stdin=b"x" * 100_000)
            assert type(e.value) is AgentEnvError
        finally:
            sb.close()
            host.close()
