"""pause/resume: processes continue exactly where they were; a paused sandbox has no process and
no memory; restores are verified; bad state transitions are refused."""

from __future__ import annotations

import time

import pytest
from agentenv_testutil import count, start_counter

from agentenv import CheckpointError, Sandbox, SandboxStateError
from agentenv.backend import criu_log, docker_client
from agentenv.backend.cgroups import CGROUP_ROOT
from agentenv.backend.containerd import tmp_dirs as containerd_tmp_dirs
from agentenv.sandbox import runtime

pytestmark = pytest.mark.docker

# A Python interpreter that executes whatever is written to a FIFO, keeping its variables between commands.
INTERPRETER = """nohup python3 -u -c '
ns = {}
while True:
    with open("/tmp/py.in") as f:
        exec(f.read(), ns)
' >/tmp/py.out 2>&1 &"""


def test_a_counting_process_continues_its_count(sandbox):
    start_counter(sandbox)
    time.sleep(0.3)
    sandbox.exec("echo before > /tmp/mark")
    before = count(sandbox)
    sandbox.pause()
    started = time.perf_counter()
    sandbox.resume()
    resumed_in = time.perf_counter() - started
    # CRIU's own share of the resume, read from the log of this very restore (what bench/sandbox.py reports)
    criu_s = criu_log.restore_seconds(runtime().backend.restore_log(sandbox.container_id))
    assert criu_s is not None and 0 < criu_s < resumed_in, (criu_s, resumed_in)
    after = count(sandbox)
    assert after >= before > 0, (before, after)  # the same process went on counting
    time.sleep(0.3)
    assert count(sandbox) > after
    assert sandbox.exec("cat /tmp/mark").stdout == "before\n"


def test_python_keeps_its_variables(sandbox):
    sandbox.exec("mkfifo /tmp/py.in && " + INTERPRETER)
    sandbox.exec("echo 'x = 41; import os; pid = os.getpid()' > /tmp/py.in")
    sandbox.pause()
    sandbox.resume()
    code = 'open("/workspace/answer", "w").write(f"{x + 1} {pid == os.getpid()}")'
    sandbox.exec(f"echo '{code}' > /tmp/py.in")
    deadline = time.monotonic() + 10
    while sandbox.exec("test -s /workspace/answer").exit_code != 0:
        assert time.monotonic() < deadline, sandbox.exec("cat /tmp/py.out").stdout
        time.sleep(0.05)
    assert sandbox.read_file("answer") == b"42 True"


def test_a_paused_sandbox_has_no_process_and_no_memory(sandbox):
    start_counter(sandbox)
    sandbox.exec("head -c 20000000 /dev/urandom > /tmp/blob")  # 20 MB in tmpfs, dumped with the processes
    running = sandbox.stats()
    assert running.rss_bytes > 20_000_000 and running.pids >= 3 and running.checkpoint_bytes == 0
    sandbox.pause()
    state = docker_client.api().inspect_container(sandbox.container_id)["State"]
    assert state["Running"] is False and state["Pid"] == 0
    assert not (CGROUP_ROOT / "memory" / "docker" / sandbox.container_id).exists()
    assert not (CGROUP_ROOT / "docker" / sandbox.container_id).exists()
    paused = sandbox.stats()
    assert (paused.state, paused.rss_bytes, paused.pids) == ("paused", 0, 0)
    assert paused.checkpoint_bytes > 20_000_000
    assert paused.cpu_seconds >= running.cpu_seconds > 0
    sandbox.resume()
    assert sandbox.exec("wc -c < /tmp/blob").stdout.strip() == "20000000"
    resumed = sandbox.stats()
    assert resumed.rss_bytes > 20_000_000 and resumed.checkpoint_bytes == 0
    assert resumed.cpu_seconds >= paused.cpu_seconds


def test_repeated_cycles_keep_the_state(sandbox):
    start_counter(sandbox)
    seen = []
    for _ in range(3):
        sandbox.pause()
        sandbox.resume()
        seen.append(count(sandbox))
    assert seen == sorted(seen) and seen[0] > 0
    assert sandbox.exec("cat /run/agentenv/sandbox-id").stdout == sandbox.id


def test_restores_leave_no_unpacked_checkpoint_copies_behind(sandbox):
    """containerd unpacks every restored checkpoint into <tmp>/ctrd-checkpoint* and never deletes it
    (containerd #10166): a leak of one checkpoint per resume or fork unless AgentENV removes it."""
    sandbox.pause()
    sandbox.resume()
    (fork,) = sandbox.fork(1)
    volumes = {f"agentenv-{sandbox.id}-ws".encode(), f"agentenv-{fork.id}-ws".encode()}
    left = [copy for tmp in containerd_tmp_dirs() for copy in tmp.glob("ctrd-checkpoint*")
            if any(v in img.read_bytes() for img in copy.glob("mountpoints-*.img") for v in volumes)]
    assert left == []


def test_state_errors_name_the_problem(sandbox):
    with pytest.raises(SandboxStateError, match="already running"):
        sandbox.resume()
    sandbox.pause()
    with pytest.raises(SandboxStateError, match="already paused"):
        sandbox.pause()
    with pytest.raises(SandboxStateError, match=f"sandbox {sandbox.id} is paused; resume it first"):
        sandbox.exec("true")
    assert Sandbox.get(sandbox.id[:6]).status == "paused"  # id prefixes work
    sandbox.resume()
    assert sandbox.exec("echo back").stdout == "back\n"


def test_a_restore_that_did_not_restore_is_detected(sandbox):
    """Docker may start a container afresh and report success; the restore marker catches it."""
    start_counter(sandbox)
    sandbox.pause()
    reg = runtime().registry
    ck = reg.latest_checkpoint(sandbox.id)
    conn = reg._conn()
    conn.execute("UPDATE checkpoints SET marker = 'not-what-was-dumped' WHERE id = ?", (ck.id,))
    with pytest.raises(CheckpointError, match="restore marker is missing"):
        sandbox.resume()
    assert sandbox.status == "paused" and "last resume failed" in sandbox.reason
    conn.execute("UPDATE checkpoints SET marker = ? WHERE id = ?", (ck.marker, ck.id))
    sandbox.resume()  # the checkpoint was kept: a retry restores the real state
    assert count(sandbox) > 1
