"""Sandbox.session(): a persistent shell with exec's guarantees (separate capped outputs, timeouts that
kill the whole process group, a session usable afterwards) that never blocks pause or fork, from any
process, and that each forked process or sandbox gets its own of."""

from __future__ import annotations

import os
import signal
import time

import pytest

from agentenv import Sandbox, SandboxStateError
from agentenv.backend import docker_client
from agentenv.errors import AgentEnvError
from agentenv.session import SESSION_ARGV, SessionError

pytestmark = pytest.mark.docker


def _procs(sb) -> str:
    return sb.exec("ps -eo args").stdout


def test_outputs_exit_code_argv_and_stdin_match_exec(sandbox):
    with sandbox.session() as s:
        r = s.run("echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
        assert not r.timed_out and not r.truncated
        assert s.run("printf partial; printf e >&2").stdout == "partial"  # no newline of our own added
        argv = ["printf", "%s|", "a b", "$HOME", "it's"]
        assert s.run(argv).stdout == sandbox.exec(argv).stdout == "a b|$HOME|it's|"
        data = bytes(range(256)) * 40 + b"'%s\\n\0"
        assert s.run("od -An -v -tx1 | tr -d ' \\n'", stdin=data).stdout == data.hex()
        assert s.run("cat", stdin="héllo").stdout == "héllo"
        assert s.run("cat").stdout == ""  # stdin is /dev/null: a command never eats the session's input
        assert s.run("pwd; id -u").stdout == sandbox.exec("pwd; id -u").stdout
        assert s.opens == 1 and not s.reopened


def test_a_10_mib_flood_is_capped_and_the_session_stays_usable(sandbox):
    limit = sandbox.config.output_limit_bytes
    with sandbox.session() as s:
        r = s.run("head -c 10485760 /dev/zero | tr '\\0' a; head -c 3000000 /dev/zero | tr '\\0' b >&2")
        assert r.exit_code == 0 and r.truncated and not r.timed_out
        assert len(r.stdout) == len(r.stderr) == limit
        assert set(r.stdout) == {"a"} and set(r.stderr) == {"b"}
        after = s.run("echo fine")
        assert (after.stdout, after.truncated, s.opens) == ("fine\n", False, 1)


def test_timeout_kills_the_process_group_and_the_session_goes_on(sandbox):
    with sandbox.session() as s:
        t0 = time.monotonic()
        r = s.run("sleep 100", timeout=1)
        assert r.timed_out and r.exit_code == 124
        assert 0.9 < time.monotonic() - t0 < 3.0
        assert "sleep 100" not in _procs(sandbox)
        # a child (and a background grandchild) that ignore TERM get KILL after the grace period
        t0 = time.monotonic()
        r = s.run("(trap '' TERM; sleep 102) & trap '' TERM; echo started; sleep 101; wait", timeout=1)
        assert r.timed_out and r.exit_code == 137 and r.stdout == "started\n"
        assert time.monotonic() - t0 < 6
        left = _procs(sandbox)
        assert "sleep 101" not in left and "sleep 102" not in left, left
        assert s.run("echo next").stdout == "next\n" and s.opens == 1 and not s.reopened


def test_a_command_that_stops_its_timeout_is_killed_by_the_host(sandbox):
    """`timeout` itself stopped: the host kills everything on the session's pipes, the shell reopens."""
    with sandbox.session() as s:
        t0 = time.monotonic()
        r = s.run("echo before; kill -STOP $PPID; sleep 103", timeout=0.5)
        assert r.timed_out and r.exit_code == 137 and r.stdout == "before\n"
        assert time.monotonic() - t0 < 15
        assert "sleep 103" not in _procs(sandbox)
        assert s.run("echo again").stdout == "again\n" and s.reopened and s.opens == 2


def test_pause_ends_open_sessions_and_they_reopen_after_resume(sandbox):
    s = sandbox.session()
    # a background job still holding the session's stdout must not block the checkpoint either
    assert s.run("sleep 1000 & echo bg").stdout == "bg\n"
    sandbox.pause()
    assert sandbox.status == "paused"
    with pytest.raises(SandboxStateError, match="paused; resume it first"):
        s.run("echo too early")
    sandbox.resume()
    assert " ".join(SESSION_ARGV) not in _procs(sandbox)  # no shell of before came back
    r = s.run("echo back")
    assert r.stdout == "back\n" and s.reopened and s.opens == 2
    assert "sleep 1000" not in _procs(sandbox)  # it was attached to the old shell's pipes
    s.close()
    with pytest.raises(SessionError, match="closed"):
        s.run("true")


def test_each_sandbox_fork_gets_its_own_session(sandbox):
    s = sandbox.session()
    s.run("echo source > /workspace/who")
    forks = sandbox.fork(2)  # pauses the source: its session shell ends
    sessions = [f.session() for f in forks]
    for i, (f, fs) in enumerate(zip(forks, sessions, strict=True)):
        assert fs.run("cat /workspace/who /run/agentenv/sandbox-id").stdout == f"source\n{f.id}"
        fs.run(f"echo fork{i} > /workspace/who")
    assert s.run("cat /workspace/who").stdout == "source\n" and s.reopened
    assert [fs.run("cat /workspace/who").stdout for fs in sessions] == ["fork0\n", "fork1\n"]


def test_a_forked_process_opens_its_own_shell_and_can_pause_another_processs_session(sandbox):
    s = sandbox.session()
    assert s.run("echo parent").stdout == "parent\n"
    parent_client = docker_client.api()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the inherited session must not use the parent's connection
        try:
            r = s.run("echo child")
            own_client = docker_client.api() is not parent_client  # the parent's pool is not shared
            ok = (r.stdout, s.reopened, s.opens, own_client) == ("child\n", True, 2, True)
            os.write(write_end, b"ok" if ok else repr((r, s.reopened, s.opens, own_client)).encode()[:200])
            time.sleep(30)  # its shell stays open while the parent pauses the sandbox
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 200) == b"ok"
        shells = [ln for ln in _procs(sandbox).splitlines() if ln.strip() == " ".join(SESSION_ARGV)]
        assert len(shells) == 2  # the parent's and the child's
        assert s.run("echo parent again").stdout == "parent again\n" and s.opens == 1
        sandbox.pause()  # ends the child's shell too, although this process never saw it
        sandbox.resume()
        assert s.run("echo resumed").stdout == "resumed\n" and s.reopened
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)


def test_bad_session_use_gets_clear_errors(sandbox):
    s = sandbox.session()
    with pytest.raises(AgentEnvError, match="positive"):
        s.run("true", timeout=0)
    with pytest.raises(AgentEnvError, match="non-empty list"):
        s.run([])
    with pytest.raises(AgentEnvError, match="stdin must be bytes or str"):
        s.run("cat", stdin=3)
    assert s.run("true").ok  # bad input does not break the session
    sandbox.pause()
    with pytest.raises(SandboxStateError, match="paused; resume it first"):
        sandbox.session()
    sandbox.close()
    with pytest.raises(SandboxStateError, match="closed"):
        Sandbox.get(sandbox.id).session()
