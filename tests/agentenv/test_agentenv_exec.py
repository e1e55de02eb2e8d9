"""Sandbox.exec: results, stdin/env/workdir, timeouts that kill the process group, output caps,
parallel use from threads, and the typed errors of bad input."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentenv import ExecTimeout, Sandbox, SandboxNotFound, SandboxStateError
from agentenv.backend import docker_client
from agentenv.backend.docker_exec import exec_pids, kill_attached, start_exec
from agentenv.errors import AgentEnvError

pytestmark = pytest.mark.docker


def test_exec_returns_exit_code_and_separate_outputs(sandbox):
    r = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert not r.timed_out and not r.truncated and r.duration_s > 0
    assert sandbox.exec(["printf", "%s|", "a b", "$HOME"]).stdout == "a b|$HOME|"


def test_exec_passes_stdin_env_and_workdir(sandbox):
    assert sandbox.exec("wc -c", stdin=b"x" * 200_000).stdout.strip() == "200000"
    assert sandbox.exec("echo $GREETING", env={"GREETING": "héllo"}).stdout == "héllo\n"
    sandbox.exec("mkdir -p /workspace/sub")
    assert sandbox.exec("pwd", workdir="/workspace/sub").stdout == "/workspace/sub\n"
    assert sandbox.exec("pwd").stdout == "/workspace\n"


def test_timeout_kills_the_whole_process_group(sandbox):
    t0 = time.monotonic()
    r = sandbox.exec("sleep 300 & sleep 301 & echo started; wait", timeout=1.5)
    assert r.timed_out and r.exit_code == 124 and r.stdout == "started\n"
    assert time.monotonic() - t0 < 10
    left = sandbox.exec("ps -eo args").stdout
    assert "sleep 300" not in left and "sleep 301" not in left, left
    with pytest.raises(ExecTimeout) as info:
        sandbox.exec("sleep 30", timeout=0.5, raise_on_timeout=True)
    assert info.value.result.timed_out


def test_a_command_that_stops_its_timeout_is_killed_by_the_host(sandbox):
    """`timeout` itself stopped: after the grace periods the host kills what is attached to the exec."""
    t0 = time.monotonic()
    r = sandbox.exec("echo before; kill -STOP $PPID; sleep 104", timeout=0.3)
    assert r.timed_out and r.exit_code == 137 and r.stdout == "before\n"
    assert time.monotonic() - t0 < 15
    assert "sleep 104" not in sandbox.exec("ps -eo args").stdout


def test_output_flood_is_capped_and_flagged(sandbox):
    r = sandbox.exec("head -c 5000000 /dev/zero | tr '\\0' a; head -c 3000000 /dev/zero | tr '\\0' b >&2")
    assert r.exit_code == 0 and r.truncated
    assert len(r.stdout) == len(r.stderr) == 1024 * 1024
    assert set(r.stdout) == {"a"} and set(r.stderr) == {"b"}
    small = sandbox.exec("echo fine")
    assert not small.truncated


def test_execs_from_many_threads_on_different_sandboxes(make_sandbox):
    boxes = [make_sandbox(), make_sandbox()]

    def step(i: int) -> tuple[str, str]:
        sb = boxes[i % 2]
        return sb.id, sb.exec(f"echo {i} $(cat /run/agentenv/sandbox-id)").stdout

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(step, range(16)))
    for i, (sid, out) in enumerate(results):
        assert out == f"{i} {sid}\n"


def test_bad_exec_inputs_get_clear_errors(sandbox):
    with pytest.raises(AgentEnvError, match="non-empty list"):
        sandbox.exec([])
    with pytest.raises(AgentEnvError, match="positive"):
        sandbox.exec("true", timeout=-1)
    with pytest.raises(AgentEnvError, match="env must map"):
        sandbox.exec("true", env={"A": 1})
    with pytest.raises(AgentEnvError, match="env must map"):
        sandbox.exec("true", env={"A=B": "x"})
    with pytest.raises(AgentEnvError, match="NUL"):
        sandbox.exec("echo a\0b")
    with pytest.raises(AgentEnvError, match="workdir must be an absolute path"):
        sandbox.exec("true", workdir="relative")
    assert sandbox.exec("pwd", workdir="/nope").exit_code == 126  # the runtime's own refusal
    with pytest.raises(SandboxNotFound, match="no sandbox"):
        Sandbox.get("ffffffffffff")


def test_exec_on_a_closed_sandbox_is_refused(make_sandbox):
    sb = make_sandbox()
    sb.close()
    sb.close()  # idempotent
    assert sb.status == "closed"
    with pytest.raises(SandboxStateError, match="closed"):
        sb.exec("true")


def test_the_host_kill_signals_only_the_sandbox_s_own_processes_never_its_init(sandbox):
    """Docker can report an exec running after it exited, and host pids are reused: a stale exec pid
    that now names a host process (or the init) must not be killed."""
    api = docker_client.api()
    init_pid = int(api.inspect_container(sandbox.container_id)["State"]["Pid"])
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        exec_id, stream = start_exec(api, sandbox.container_id, ["sleep", "60"], user="root", stdin=False)
        deadline = time.monotonic() + 10
        while (ids := exec_pids(api, exec_id))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        pid, init = ids
        assert init == init_pid and pid > 0
        kill_attached([bystander.pid, init_pid, pid], init_pid, wait_s=5.0)
        assert bystander.poll() is None, "a host process outside the sandbox was killed"
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        stream.close()
        assert sandbox.exec("echo alive").stdout == "alive\n"
        assert api.inspect_container(sandbox.container_id)["State"]["Pid"] == init_pid
    finally:
        bystander.kill()
        bystander.wait()
