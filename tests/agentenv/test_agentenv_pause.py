"""pause/resume: processes continue exactly where they were; a paused sandbox has no process and
no memory; restores are verified; bad state transitions are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agentenv_testutil import count, start_counter

from agentenv import CheckpointError, Sandbox, SandboxStateError
from agentenv.backend import criu_log, docker_client
from agentenv.backend.cgroups import CGROUP_ROOT
from agentenv.backend.containerd import tmp_dirs as containerd_tmp_dirs
from agentenv.pool.cpu import HOST, OpCpu, host_cpu_seconds, runtime_cgroups
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[2]
BURN_HALF_A_SECOND = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"

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
    """A checkpoint is restored only with the images the registry recorded for it (its marker): Docker
    may start a container afresh and report success (Docker backends), and a checkpoint folder may hold
    other images than the pause wrote (both backends). The checkpoint is kept for a retry."""
    start_counter(sandbox)
    sandbox.pause()
    reg = runtime().registry
    ck = reg.latest_checkpoint(sandbox.id)
    conn = reg._conn()
    conn.execute("UPDATE checkpoints SET marker = 'not-what-was-dumped' WHERE id = ?", (ck.id,))
    with pytest.raises(CheckpointError, match="restore marker is missing|other images than the registry"):
        sandbox.resume()
    assert sandbox.status == "paused" and "last resume failed" in sandbox.reason
    conn.execute("UPDATE checkpoints SET marker = ? WHERE id = ?", (ck.marker, ck.id))
    sandbox.resume()  # the checkpoint was kept: a retry restores the real state
    assert count(sandbox) > 1


def test_a_pause_and_resume_are_charged_the_runtimes_cpu_read_in_its_own_cgroup(sandbox):
    """The bootstrap's scripts/ensure_dockerd.sh puts dockerd and containerd in a cgroup of their own
    (unless a service manager already did): the pool charges a pause + resume the runtime's CPU read there
    (CRIU, runc, shims, daemons) plus its own thread's, not the whole host's busy time."""
    subprocess.run(["bash", str(ROOT / "scripts" / "ensure_dockerd.sh")], check=True, timeout=120)
    assert runtime_cgroups(), "dockerd/containerd sit in the root cgroup: the runtime's CPU is not apart"
    start_counter(sandbox)
    meter, host0 = OpCpu(), host_cpu_seconds()
    token = meter.start()
    # another process busy meanwhile (outside the runtime): the host's counter would charge it
    burner = subprocess.Popen([sys.executable, "-c", BURN_HALF_A_SECOND])
    sandbox.pause()
    sandbox.resume()
    os.waitid(os.P_PID, burner.pid, os.WEXITED | os.WNOWAIT)  # its burn inside the window, not reaped
    # CRIU's copies back, inside the restored processes: a lazy resume charges them as the processes run
    # again, so read once the counter has run (within 5 s: a busy host can schedule it late)
    deadline = time.monotonic() + 5
    while (restored := sandbox.stats().cpu_seconds_since_start) == 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    charged, host = meter.stop(token, restored_cpu_s=restored), host_cpu_seconds() - host0
    _pid, _status, usage = os.wait4(burner.pid, 0)  # reaped after the stop: not a waited-for child in it
    burned = usage.ru_utime + usage.ru_stime
    assert meter.source != HOST
    assert burned >= 0.4
    assert restored > 0.0
    assert 0.05 + restored < charged <= host - burned + 0.05, (charged, restored, host, burned)
