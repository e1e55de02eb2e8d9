"""`agentenv serve` killed (SIGKILL) in the middle of a pause, or of a resume, then started again on the same
home: the sandbox is back, paused when its checkpoint finished (a resume restores it, verified), else
running, with its files and its processes' memory. The kill lands at named points through
`$AGENTENV_FAULT` (`agentenv.faults`), and once for real while CRIU dumps (the dump outlives the server).
"""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import pytest
from netns_hosts import API_KEY
from test_server_faults import CALL_TIMEOUT_S, _listed, _sdk, served  # noqa: F401 - `served`: the fixture

pytestmark = pytest.mark.docker

# A process that keeps MiBs of random bytes in memory and their hash in a tmpfs file: the same hash
# after a resume proves the processes came back from the checkpoint (a fresh start has no /tmp/token).
MEMORY_PROCESS = (
    "nohup python3 -c \"import hashlib,os,time; s=os.urandom(1<<20); b=s*{mib}; "
    "open('/tmp/token','w').write(hashlib.sha256(s).hexdigest()); time.sleep(10**6)\" >/dev/null 2>&1 & "
    "while [ ! -s /tmp/token ]; do sleep 0.05; done; cat /tmp/token")
HEADERS = {"X-API-Key": API_KEY}


def _sandbox_with_state(srv, mib: int | None = 48) -> tuple[object, str, str | None]:
    """A running SDK sandbox with a file in its work dir and a process holding `mib` MiB of memory (none
    with `mib=None`: nothing runs but its init): (sandbox, the file's text, the process's token or None)."""
    sbx = _sdk().create("base", timeout=600, request_timeout=CALL_TIMEOUT_S)
    mark = f"written before the pause by {sbx.sandbox_id}\n"
    sbx.files.write("mark.txt", mark, request_timeout=CALL_TIMEOUT_S)
    if mib is None:
        return sbx, mark, None
    token = sbx.commands.run(MEMORY_PROCESS.format(mib=mib), request_timeout=CALL_TIMEOUT_S).stdout.strip()
    assert len(token) == 64, token
    return sbx, mark, token


def _died_in(srv, call: threading.Thread | None = None) -> None:
    """The server was SIGKILLed (by its crash point, or by the test)."""
    assert srv.proc.wait(timeout=60) == -9, srv.log.read_text()[-2000:]
    if call is not None:
        call.join(timeout=CALL_TIMEOUT_S)
        assert not call.is_alive(), "the client's call hung after the server died"


def _post_pause(srv, sandbox_id: str) -> list[BaseException]:
    """The pause call, expected to break with the server's death; its error is kept in the list."""
    errors: list[BaseException] = []
    try:
        httpx.post(f"{srv.url}/sandboxes/{sandbox_id}/pause", headers=HEADERS, timeout=CALL_TIMEOUT_S)
    except httpx.TransportError as e:
        errors.append(e)
    return errors


def _back_and_usable(srv, sandbox_id: str, state: str, mark: str, token: str | None) -> None:
    """Listed in `state`; connect (a resume when paused), then its file and its process's memory (unless
    `token` is None: no process of its own) are there and commands run."""
    assert _listed().get(sandbox_id) == state, (sandbox_id, _listed(), srv.log.read_text()[-3000:])
    try:
        sbx = _sdk().connect(sandbox_id, timeout=600, request_timeout=CALL_TIMEOUT_S)
        assert sbx.files.read("mark.txt", request_timeout=CALL_TIMEOUT_S) == mark
        if token is not None:
            assert sbx.commands.run("cat /tmp/token", request_timeout=CALL_TIMEOUT_S).stdout.strip() == token
        assert sbx.commands.run("echo ok", request_timeout=CALL_TIMEOUT_S).stdout == "ok\n"
        sbx.pause(request_timeout=CALL_TIMEOUT_S)  # and it pauses and resumes again
        again = _sdk().connect(sandbox_id, timeout=600, request_timeout=CALL_TIMEOUT_S)
        if token is not None:
            assert again.commands.run("cat /tmp/token",
                                      request_timeout=CALL_TIMEOUT_S).stdout.strip() == token
        assert again.commands.run("echo ok", request_timeout=CALL_TIMEOUT_S).stdout == "ok\n"
        again.kill(request_timeout=CALL_TIMEOUT_S)
    except Exception as exc:  # a call that failed or outlived CALL_TIMEOUT_S: what the server was doing
        raise AssertionError(f"{type(exc).__name__}: {exc}; the server's log ends:\n"
                             f"{srv.log.read_text()[-4000:]}") from exc


def _left_in_store(srv, sandbox_id: str) -> list[str]:
    """Files of the sandbox's container in the checkpoint store (reservations, work dirs, images)."""
    from agentenv.backend.settings import BackendSettings

    short = srv.container_of(sandbox_id)  # `docker ps -q`: the id's first 12 digits
    dirs = BackendSettings.load().store_dir.glob(short + "*")
    return sorted(p.name for cdir in dirs for p in cdir.iterdir())


@pytest.mark.parametrize(("point", "state"), [
    ("pause-start", "running"),     # before anything happened
    ("pause-dumped", "paused"),     # CRIU's dump finished and the container stopped; the registry not told
    ("pause-recorded", "paused"),   # the registry says paused; the E2B row's end time not yet set
    ("warm-dumped", "paused"),      # warm backend: CRIU finished, the tree left stopped, nothing sealed
    ("warm-sealed", "paused"),      # warm backend: the images sealed (record written), the tree not killed
])
def test_a_server_killed_at_a_point_of_a_pause_loses_nothing(served, point, state):  # noqa: F811
    served.stop()
    served.start(AGENTENV_FAULT=point)
    sbx, mark, token = _sandbox_with_state(served)
    assert _post_pause(served, sbx.sandbox_id), "the pause answered although the server died in it"
    _died_in(served)
    served.start()
    assert len(_left_in_store(served, sbx.sandbox_id)) == (state == "paused")  # one checkpoint, no leftover
    _back_and_usable(served, sbx.sandbox_id, state, mark, token)


def test_a_server_killed_while_criu_dumps_loses_nothing(served):  # noqa: F811
    """A real kill -9 while the dump runs: CRIU (and containerd's `ctr` on the Docker backends) finish it
    after the server is gone, so the restarted server finds a finished dump without the backend's record
    (the warm backend: its processes still stopped; the Docker backends: the container stopped)."""
    from agentenv.backend.base import ContainerRef
    from agentenv.runtime import runtime

    sbx, mark, token = _sandbox_with_state(served, mib=96)  # a dump long enough to be seen running
    errors: list[BaseException] = []
    for _attempt in range(3):  # a poll can miss a whole dump when the host is loaded: pause again
        name = served.container_of(sbx.sandbox_id)
        container = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", name], capture_output=True,
                                   text=True, timeout=60, check=True).stdout.strip()  # fmt: skip
        errors.clear()
        call = threading.Thread(target=lambda: errors.extend(_post_pause(served, sbx.sandbox_id)),
                                daemon=True)  # fmt: skip
        call.start()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        ref = ContainerRef(container, "")
        while not (seen := runtime().backend.dump_in_progress(ref)) and call.is_alive():
            assert time.monotonic() < deadline, "no dump of the sandbox started"
            time.sleep(0.002)
        if seen:
            break
        call.join()  # the pause finished before a poll saw its dump: the sandbox is paused, resume it
        _sdk().connect(sbx.sandbox_id, timeout=600, request_timeout=CALL_TIMEOUT_S)
    else:
        pytest.fail("three pauses finished before their dump was seen running")
    served.kill9()
    _died_in(served, call)
    assert errors, "the pause answered although the server died in it"
    served.start()
    assert len(_left_in_store(served, sbx.sandbox_id)) == 1  # the finished checkpoint; no reservation
    _back_and_usable(served, sbx.sandbox_id, "paused", mark, token)


@pytest.mark.parametrize("mib", [48, None], ids=["a process of its own", "nothing but its init"])
def test_a_server_killed_after_a_verified_resume_dropped_its_checkpoint(served, mib):  # noqa: F811
    """The resume restored (verified) and deleted its checkpoint, then the server died before recording
    the sandbox running: it is running after the restart (a rollback would stop it with no images left).
    A resumed tree of nothing but its init looks like a paused warm shell: its gone checkpoint tells."""
    sbx, mark, token = _sandbox_with_state(served, mib)
    sbx.pause(request_timeout=CALL_TIMEOUT_S)
    served.stop()
    served.start(AGENTENV_FAULT="checkpoint-discarded")
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{served.url}/sandboxes/{sbx.sandbox_id}/connect", headers=HEADERS, json={"timeout": 600},
                   timeout=CALL_TIMEOUT_S)
    _died_in(served)
    served.start()
    assert _left_in_store(served, sbx.sandbox_id) == []  # the half-deleted images went
    _back_and_usable(served, sbx.sandbox_id, "running", mark, token)
