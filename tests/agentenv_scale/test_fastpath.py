"""The fast path against a real dockerd + CRIU: state survives pause/resume/fork, Docker's view stays
consistent (exec works), a fresh start is caught, and images are accounted for and cleaned up."""

from __future__ import annotations

import time
from pathlib import Path

import docker
import pytest

from agentenv.errors import CheckpointError, SandboxStateError
from agentenv.fastpath import DiskCapExceeded, FastPath, RestoreNotVerified
from agentenv.fastpath.clone import FORK_LABEL, remove_container
from agentenv.fastpath.host import filesystem_type
from agentenv.fastpath.procs import memory_bytes

pytestmark = pytest.mark.docker


def read_state(client: docker.DockerClient, cid: str) -> tuple[str, int, str]:
    """(token, count, digest) as published by STATE_PROGRAM, read through `docker exec`."""
    for _ in range(100):
        r = client.api.exec_create(cid, ["cat", "/tmp/state"])
        out = client.api.exec_start(r["Id"]).decode()
        if client.api.exec_inspect(r["Id"])["ExitCode"] == 0 and out.count(" ") == 2:
            token, count, digest = out.split()
            return token, int(count), digest
        time.sleep(0.05)
    raise AssertionError(f"container {cid[:12]} never published its state")


def wait_count_above(client: docker.DockerClient, cid: str, value: int) -> tuple[str, int, str]:
    deadline = time.time() + 20
    while time.time() < deadline:
        state = read_state(client, cid)
        if state[1] > value:
            return state
        time.sleep(0.05)
    raise AssertionError(f"container {cid[:12]}: counter did not move past {value}")


def sh(client: docker.DockerClient, cid: str, cmd: str, user: str = "1000") -> str:
    r = client.containers.get(cid).exec_run(["sh", "-c", cmd], user=user)
    assert r.exit_code == 0, r.output
    return r.output.decode()


def test_pause_resume_keeps_memory_and_docker_view(fastpath: FastPath, make_container, docker_client):
    cid = make_container()
    token, _, digest = wait_count_above(docker_client, cid, 10)  # past the first digest refresh
    sh(docker_client, cid, "echo before > /workspace/notes.txt")

    record = fastpath.pause(cid)
    info = docker_client.api.inspect_container(cid)
    assert info["State"]["Running"] is False and info["State"]["Pid"] == 0  # Docker saw the task end
    assert memory_bytes(info["State"]["Pid"]) == 0
    assert record.path.is_dir() and record.image_bytes > 8 * 2**20  # the 8 MiB buffer is on disk
    assert filesystem_type(record.path) not in ("tmpfs", "ramfs")
    assert record.processes and record.processes[0].ns_pid == 1
    assert fastpath.disk_usage() >= record.image_bytes

    with pytest.raises(SandboxStateError):
        fastpath.pause(cid)  # nothing left to pause

    fastpath.resume(cid)
    assert docker_client.api.inspect_container(cid)["State"]["Running"] is True
    t2, c2, d2 = read_state(docker_client, cid)
    assert t2 == token, "a fresh process (new token): the restore did not restore"
    assert d2 == digest
    later = wait_count_above(docker_client, cid, c2 + 10)  # it keeps running and recomputed the digest
    assert later[0] == token and later[2] == digest
    assert sh(docker_client, cid, "cat /workspace/notes.txt").strip() == "before"
    assert not record.path.exists(), "resume deletes the images it used"

    # Repeated cycles, with a process started by `docker exec` after the restore each time (CRIU puts
    # restored trees into a new time namespace unless told otherwise; exec'd processes are not in it).
    for i in range(2):
        sh(docker_client, cid, f"nohup sleep {600 + i} >/dev/null 2>&1 &", user="0")
        fastpath.pause(cid)
        fastpath.resume(cid)
        assert read_state(docker_client, cid)[0] == token
        assert f"sleep {600 + i}" in sh(docker_client, cid, "ps -eo args", user="0")


def test_fork_copies_memory_and_files_and_forks_diverge(fastpath: FastPath, make_container, docker_client):
    cid = make_container()
    token, _, digest = wait_count_above(docker_client, cid, 10)
    sh(docker_client, cid, "mkdir -p /workspace/src && echo shared > /workspace/src/a.txt")

    forks = fastpath.fork(cid, 2)
    assert len(forks) == 2 and cid not in forks
    all_ids = [cid, *forks]
    for c in all_ids:
        info = docker_client.api.inspect_container(c)
        assert info["State"]["Running"], c
        t, _, d = read_state(docker_client, c)
        assert (t, d) == (token, digest)
        assert sh(docker_client, c, "cat /workspace/src/a.txt").strip() == "shared"
    assert docker_client.api.inspect_container(forks[0])["Config"]["Labels"][FORK_LABEL] == cid

    # A fork can be paused and resumed again, also with processes started in it after its restore.
    sh(docker_client, forks[1], "nohup sleep 700 >/dev/null 2>&1 &", user="0")
    fastpath.pause(forks[1])
    fastpath.resume(forks[1])
    assert read_state(docker_client, forks[1])[0] == token

    # Each copy continues on its own: files written in one are not seen by the others.
    sh(docker_client, forks[0], "echo mine > /workspace/src/a.txt")
    assert sh(docker_client, forks[1], "cat /workspace/src/a.txt").strip() == "shared"
    assert sh(docker_client, cid, "cat /workspace/src/a.txt").strip() == "shared"
    counts = [wait_count_above(docker_client, c, 0)[1] for c in all_ids]
    assert all(n > 0 for n in counts)
    assert fastpath.store.latest(cid) is None, "a running source's fork checkpoint is deleted afterwards"


def test_fork_from_paused_template_keeps_it_paused(fastpath: FastPath, make_container, docker_client):
    cid = make_container()
    token, _, _ = wait_count_above(docker_client, cid, 3)
    template = fastpath.pause(cid)
    forks = fastpath.fork(cid, 1)
    assert docker_client.api.inspect_container(cid)["State"]["Running"] is False
    assert template.path.exists(), "a paused template keeps its images for further warm starts"
    assert read_state(docker_client, forks[0])[0] == token
    again = fastpath.fork(cid, 1)
    assert read_state(docker_client, again[0])[0] == token


def test_fresh_start_is_not_taken_for_a_restore(fastpath: FastPath, make_container, docker_client):
    cid = make_container()
    wait_count_above(docker_client, cid, 3)
    record = fastpath.pause(cid)
    started = time.time()
    docker_client.api.start(cid)  # a plain start: a new process, the checkpointed state is gone
    with pytest.raises(RestoreNotVerified):
        fastpath._verify(cid, record, started)


def test_disk_cap_refuses_pause_and_leaves_sandbox_running(fastpath: FastPath, make_container, docker_client):
    cid = make_container()
    before = wait_count_above(docker_client, cid, 3)
    small = FastPath(fastpath.settings.replace(disk_cap=fastpath.disk_usage() + 2 * 2**20), docker_client.api)
    with pytest.raises(DiskCapExceeded, match="keeps running"):
        small.pause(cid)
    assert docker_client.api.inspect_container(cid)["State"]["Running"]
    assert wait_count_above(docker_client, cid, before[1])[0] == before[0]
    assert small.store.latest(cid) is None


def test_discard_and_gc_reclaim_images(fastpath: FastPath, make_container, docker_client):
    cid = make_container()
    wait_count_above(docker_client, cid, 3)
    record = fastpath.pause(cid)
    assert fastpath.discard(cid) > 0 and not record.path.exists()

    orphan = make_container()
    wait_count_above(docker_client, orphan, 3)
    rec2 = fastpath.pause(orphan)
    docker_client.api.remove_container(orphan, force=True, v=True)  # removed behind AgentENV's back
    report = fastpath.gc()
    assert report.orphan_containers >= 1 and report.freed_bytes >= rec2.image_bytes // 2
    assert not rec2.path.exists()


def test_refuses_restart_policies_and_missing_checkpoints(fastpath: FastPath, docker_client, base_image):
    c = docker_client.containers.run(
        base_image,
        ["sleep", "60"],
        detach=True,
        network_mode="none",
        restart_policy={"Name": "always"},
        labels={"org.k3rl.test": "agentenv_scale"},
    )
    try:
        with pytest.raises(CheckpointError, match="restart policy"):
            fastpath.pause(c.id)
        c.stop(timeout=0)
        with pytest.raises(CheckpointError, match="no checkpoint"):
            fastpath.resume(c.id)
    finally:
        remove_container(docker_client.api, c.id)  # tolerates a concurrent session's cleanup


def test_store_on_tmpfs_is_refused(tmp_path: Path):
    from agentenv.fastpath.errors import FastPathConfigError
    from agentenv.fastpath.host import check_store_dir

    if filesystem_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this host")
    with pytest.raises(FastPathConfigError, match="tmpfs"):
        check_store_dir(Path("/dev/shm/agentenv-images"))
