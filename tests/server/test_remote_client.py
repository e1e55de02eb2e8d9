"""`agentenv.remote` as a library against a running `agentenv serve`: exec's guarantees (argv/stdin/env/
workdir, timeout, output cap), typed errors with the server's message, placement over several hosts
(one of them dead) and bounded failure on a host that does not answer."""

from __future__ import annotations

import dataclasses
import time

import pytest

from agentenv.errors import ExecTimeout, PathOutsideWorkspace, SandboxNotFound, SandboxStateError
from agentenv.remote import HostUnavailable, RemoteSandbox, RemoteSettings, SandboxHost, SandboxHosts

pytestmark = [pytest.mark.docker]
DEAD = "http://127.0.0.1:9"  # discard port: nothing listens


def test_remote_sandbox_exec_files_and_typed_errors(server):
    host = SandboxHost(server.url, server.api_key)
    sb = host.create(image="base", labels={"run": "client-test"})
    try:
        assert RemoteSandbox.get(sb.id[:8], server=server.url, api_key=server.api_key).id == sb.id
        r = sb.exec(["sh", "-c", 'printf "%s|%s|" "$A" "$(pwd)"; cat'], stdin="in put", env={"A": "b c"},
                    workdir="/tmp")
        assert (r.exit_code, r.stdout, r.timed_out) == (0, "b c|/tmp|in put", False)
        limit = sb.config.output_limit_bytes
        r = sb.exec(f"head -c {limit + 5000} /dev/zero | tr '\\0' x; exit 3")
        assert r.exit_code == 3 and r.truncated and len(r.stdout) == limit
        started = time.monotonic()
        with pytest.raises(ExecTimeout) as e:
            sb.exec("sleep 30", timeout=1, raise_on_timeout=True)
        assert e.value.result.exit_code == 124 and time.monotonic() - started < 10

        sb.write_file("bin/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
        assert sb.exec("./bin/run.sh").stdout == "ran\n"
        assert sb.read_file("/workspace/bin/run.sh").startswith(b"#!/bin/sh")
        with pytest.raises(PathOutsideWorkspace):
            sb.write_file("../../etc/x", b"no")
        with pytest.raises(FileNotFoundError, match=server.url):
            sb.read_file("missing.txt")

        session = sb.session()
        assert session.run("echo $((6 * 7))").stdout == "42\n"
        session.close()
        assert session.closed

        sb.pause()
        with pytest.raises(SandboxStateError, match="paused"):
            sb.exec("true")
        with pytest.raises(SandboxStateError, match="already paused"):
            sb.pause()
        assert sb.stats().rss_bytes < 8 * 2**20  # at most a warm shell: its init and tmpfs (warm_tmpfs_limit)
        sb.resume()
        assert sb.describe()["labels"]["run"] == "client-test"
    finally:
        sb.close()
    assert sb.status == "closed"
    sb.close()  # closing a closed sandbox is a no-op, as locally
    with pytest.raises(SandboxNotFound, match="no sandbox"):
        host.get(sb.id)


def test_placement_skips_dead_hosts_and_bounded_failure(server):
    # the configured attempts, with a short first backoff: each call to the dead host still makes them all
    settings = dataclasses.replace(RemoteSettings.load(), retry_backoff_s=0.05)
    hosts = SandboxHosts([DEAD, server.url], server.api_key, settings)
    assert hosts.pick().url == server.url
    sb = hosts.create(image="base")
    try:
        assert hosts.host_of(sb.id).url == server.url
        assert SandboxHosts([DEAD, server.url], server.api_key, settings).get(sb.id).id == sb.id
    finally:
        sb.close()
    started = time.monotonic()
    with pytest.raises(HostUnavailable, match=rf"no sandbox host answered.*after {settings.retries} attempt"):
        SandboxHosts([DEAD], server.api_key, settings).create(image="base")
    assert time.monotonic() - started < 20
    with pytest.raises(Exception, match="invalid API key"):
        SandboxHost(server.url, "wrong-key").list()
