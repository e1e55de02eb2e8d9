"""The warm backend's state moves, against real Docker and CRIU: a pause leaves the container up with
nothing but its init (a warm shell) and a resume restores the process tree into that very shell, its
memory served lazily; a stopped shell is started and its tmpfs unpacked; the tree comes back with its
PIDs, sessions and process groups; forks restore into spare shells made ahead, their pages KSM-mergeable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from agentenv_testutil import TOKEN_PROCESS, count, start_counter

from agentenv import Sandbox, spares
from agentenv.backend.base import ContainerRef
from agentenv.backend.cgroups import cgroup_pids
from agentenv.backend.docker_client import api
from agentenv.backend.warm import WarmRuntime
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker


@pytest.fixture(autouse=True)
def _warm(agentenv_home):
    if not isinstance(runtime().backend, WarmRuntime):
        pytest.fail(f"these tests need the warm backend; {runtime().backend.name!r} runs "
                    "(conf/agentenv/backend.yaml names the default)")


def _init_pid(sb: Sandbox) -> int:
    return int(api().inspect_container(sb.container_id)["State"]["Pid"] or 0)


def _sleeps(sb: Sandbox) -> dict[int, tuple[int, int, str]]:
    """{pid: (pgid, sid, command line)} of the long `sleep 90x` processes inside the sandbox."""
    out = sb.exec("ps -eo pid=,pgid=,sid=,args=").stdout.split("\n")
    rows = [line.split(None, 3) for line in out if line.strip()]
    return {int(p): (int(g), int(s), a) for p, g, s, a in rows if a.startswith("sleep 90")}


def test_a_pause_keeps_a_warm_shell_and_a_resume_restores_into_it(sandbox):
    start_counter(sandbox)
    sandbox.exec("setsid sh -c 'sleep 900 & sleep 901' >/dev/null 2>&1 &")  # a session of its own
    sandbox.exec("nohup sleep 902 >/dev/null 2>&1 &")                      # a dead session leader's
    time.sleep(0.3)
    before, init = _sleeps(sandbox), _init_pid(sandbox)
    assert len(before) == 3
    sandbox.pause()
    assert _init_pid(sandbox) == init, "the shell (the container and its init) stays up"
    assert cgroup_pids(init) == [init], "a paused sandbox keeps no process but the shell's init"
    sandbox.resume()
    assert _init_pid(sandbox) == init
    assert _sleeps(sandbox) == before, "every process is back with its PID, process group and session"
    first = count(sandbox)
    time.sleep(0.3)
    assert count(sandbox) > first, "the restored counter counts on"
    assert runtime().backend.restore_log(sandbox.container_id).read_text().count("Restore finished") == 1


def test_memory_comes_back_lazily_and_whole(sandbox):
    sandbox.exec("nohup python3 -c \"import hashlib,os,time; b=os.urandom(24<<20); "
                 "open('/tmp/sum','w').write(hashlib.sha256(b).hexdigest()); "
                 "time.sleep(5); open('/tmp/again','w').write(hashlib.sha256(b).hexdigest()); "
                 "time.sleep(10**6)\" >/dev/null 2>&1 &")
    deadline = time.monotonic() + 20
    while sandbox.exec("test -s /tmp/sum").exit_code != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sandbox.pause()
    sandbox.resume()
    filled = runtime().backend.page_fill_seconds(sandbox.container_id, timeout_s=30)
    assert filled is not None and 0 < filled < 30, "the page daemon sent every page and exited"
    while sandbox.exec("test -s /tmp/again").exit_code != 0:
        assert time.monotonic() < deadline + 10
        time.sleep(0.1)
    assert sandbox.exec("cat /tmp/again").stdout == sandbox.exec("cat /tmp/sum").stdout


HASHER = ("nohup python3 -c \"import hashlib,os,time\n"
          "b = [os.urandom(4096) for _ in range(40000)] + [bytearray(os.urandom(1 << 20)) * 96]\n"
          "h = lambda: hashlib.sha256(b''.join(bytes(x) for x in b)).hexdigest()\n"
          "open('/tmp/sum', 'w').write(h())\n"
          "while True:\n"
          "    if os.path.exists('/tmp/ask'):\n"
          "        os.remove('/tmp/ask'); open('/tmp/h.tmp', 'w').write(h())\n"
          "        os.rename('/tmp/h.tmp', '/tmp/h')\n"
          "    time.sleep(0.02)\" >/dev/null 2>&1 &")


def _rehashed(sb: Sandbox) -> bool:
    """Whether the HASHER process of `sb` still runs and hashes its memory to what it hashed at first."""
    sb.exec("rm -f /tmp/h; touch /tmp/ask")
    deadline = time.monotonic() + 40
    while sb.exec("test -s /tmp/h").exit_code != 0:
        if "python3" not in sb.exec("ps -eo args").stdout or time.monotonic() > deadline:
            return False  # it crashed (memory missing) or hangs
        time.sleep(0.1)
    return sb.exec("cat /tmp/h").stdout == sb.exec("cat /tmp/sum").stdout


FORK_AND_STOP_ITS_DAEMON = (
    "import os, signal, sys\n"
    "from agentenv import Sandbox\n"
    "from agentenv.runtime import runtime\n"
    "child = Sandbox.get(sys.argv[1]).fork(1)[0]\n"
    "daemon = runtime().backend._last_daemon[child.container_id]\n"
    "os.kill(daemon.proc.pid, signal.SIGSTOP)\n"
    "print(child.id, daemon.proc.pid, daemon.finished is None, flush=True)\n")


def test_a_fork_of_a_sandbox_whose_pages_still_arrive_waits_for_them_and_loses_none(make_sandbox):
    """Forking a running sandbox dumps it first. When that sandbox is itself a fresh lazy restore (a fork,
    a resume) whose page daemon still sends pages, the dump waits for the last one, whichever process
    started the daemon: a dump taken before loses the missing pages, and the sandbox and all its forks
    come back with a crashed process. Each daemon here is stopped for 2 s to hold its pages back."""
    source = make_sandbox(memory="1g")
    source.exec(HASHER)
    deadline = time.monotonic() + 60
    while source.exec("test -s /tmp/sum").exit_code != 0:
        assert time.monotonic() < deadline, "the hashing process did not start"
        time.sleep(0.1)
    source.pause()
    # restored by another process, which exits with its daemon stopped: this process knows only its marker
    out = subprocess.run([sys.executable, "-c", FORK_AND_STOP_ITS_DAEMON, source.id], capture_output=True,
                         text=True, env=os.environ.copy(), timeout=120)
    middle_id, pid, pending = out.stdout.split()
    assert pending == "True", "the page daemon was done already"
    middle = Sandbox.get(middle_id)
    threading.Timer(2.0, os.kill, (int(pid), signal.SIGCONT)).start()
    made = [middle]
    try:
        kid = middle.fork(1)[0]
        made.append(kid)
        daemon = runtime().backend._last_daemon[kid.container_id]  # restored by this process: its own daemon
        try:
            os.kill(daemon.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:  # done: all its pages came at once, or its process crashed at once
            assert _rehashed(middle), "the forked sandbox's memory came back whole"
            pytest.fail("the page daemon of the fork's fork was done already")
        assert daemon.finished is None, "the page daemon was done already"
        threading.Timer(2.0, os.kill, (daemon.proc.pid, signal.SIGCONT)).start()
        made.append(kid.fork(1)[0])
        assert _rehashed(middle), "the forked sandbox's memory came back whole"
        assert all(_rehashed(sb) for sb in made[1:]), "its forks' memory came back whole"
    finally:
        for sb in made:
            sb.close()


def test_a_stopped_shell_is_started_and_its_tmpfs_unpacked(sandbox):
    sandbox.exec(TOKEN_PROCESS)
    sandbox.exec("mkdir -p /tmp/d && echo kept > /tmp/d/f && ln -s /tmp/d/f /tmp/link")
    token = sandbox.exec("cat /tmp/token").stdout
    sandbox.pause()
    assert runtime().backend.cool(ContainerRef(sandbox.container_id, "")) is True
    assert api().inspect_container(sandbox.container_id)["State"]["Running"] is False
    sandbox.resume()
    assert sandbox.exec("cat /tmp/token; cat /tmp/link").stdout == token + "kept\n"
    assert sandbox.exec("readlink /tmp/link").stdout.strip() == "/tmp/d/f"


def test_a_running_sandbox_is_never_cooled(sandbox):
    """Only a paused sandbox's shell may stop: a running one with no process of its own looks the same
    from its cgroup (its init alone), but has no checkpoint to come back from."""
    sandbox.exec("echo kept > /tmp/f")
    assert runtime().backend.cool(ContainerRef(sandbox.container_id, "")) is False
    assert sandbox.exec("cat /tmp/f").stdout == "kept\n"


def test_forks_restore_into_spare_shells_with_mergeable_pages_and_their_own_identity(sandbox):
    sandbox.exec(TOKEN_PROCESS)
    token = sandbox.exec("cat /tmp/token").stdout
    sandbox.pause()
    first = sandbox.fork(2)
    deadline = time.monotonic() + 30
    while len(_spares_of(sandbox)) < 2:  # made in the background for the next fork of the template
        assert time.monotonic() < deadline, "no spare shells were made after the fork"
        time.sleep(0.2)
    waiting = set(_spares_of(sandbox))
    second = sandbox.fork(2)
    assert {f.id for f in second} == waiting, "the second fork took the spares"
    assert all(s.id not in {f.id for f in Sandbox.list()} for s in _spare_records()), "spares are not listed"
    ids = set()
    for f in [*first, *second]:
        assert f.status == "running" and f.parent_id == sandbox.id
        assert f.exec("cat /tmp/token").stdout == token
        ids.add(f.exec("cat /run/agentenv/sandbox-id").stdout)
        merge = [_ksm_stat(p).get("ksm_merge_any") for p in cgroup_pids(_init_pid(f)) if p != _init_pid(f)]
        assert merge and all(m == "yes" for m in merge), "a fork's processes are KSM-mergeable"
    assert ids == {f.id for f in [*first, *second]}
    assert sandbox.status == "paused"
    for f in [*first, *second]:
        f.close()
    spares.expire(runtime(), ttl_s=0)
    assert not _spares_of(sandbox), "expired spares are removed"


def _spare_records():
    return [r for r in runtime().registry.list_sandboxes() if r.state == spares.SPARE]


def _spares_of(sb: Sandbox) -> list[str]:
    key = spares.template_key(sb.image, sb.user, sb.config.to_dict())
    return [r.id for r in _spare_records() if r.labels.get(spares.TEMPLATE_LABEL) == key]


def _ksm_stat(pid: int) -> dict[str, str]:
    try:
        text = open(f"/proc/{pid}/ksm_stat").read()
    except OSError:
        return {}
    return dict(line.replace(":", " ").split(None, 1) for line in text.splitlines() if line.strip())
