"""Host-level behaviour: the CRIU uid probe, dockerd restarting under a paused sandbox, the registry
shared across processes, and content-hashed images."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest
from agentenv_testutil import ROOT, count, start_counter
from dockerd_restart import dockerd_pid, restart_blockers, restart_dockerd

from agentenv.backend import docker_client, images
from agentenv.backend.containers import cap_sys_resource_in_bounding_set
from agentenv.errors import ImageError, SandboxBusy
from agentenv.locks import sandbox_lock
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker


def test_uid_probe_is_cached_and_agrees_with_the_host(base_image, agentenv_home):
    backend = runtime().backend
    fresh = backend.probe(base_image, refresh=True)
    cached = json.loads((agentenv_home / "host-probe.json").read_text())
    assert cached["can_checkpoint_other_uids"] == fresh.can_checkpoint_other_uids
    assert backend.probe(base_image) == fresh
    if not cap_sys_resource_in_bounding_set():
        # CRIU needs CAP_SYS_RESOURCE to handle another uid's rlimits (this machine lacks it)
        assert not fresh.can_checkpoint_other_uids and fresh.auto_user == "root"
        assert "CAP_SYS_RESOURCE" in fresh.detail
    if fresh.can_checkpoint_other_uids:
        assert fresh.auto_user == "agent"


def test_registry_and_locks_are_shared_across_processes(sandbox, agentenv_home):
    code = ("import sys; from agentenv import Sandbox; sb = Sandbox.get(sys.argv[1]); "
            "print(sb.status, sb.exec('cat /run/agentenv/sandbox-id').stdout)")
    out = subprocess.run([sys.executable, "-c", code, sandbox.id], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=60)
    assert out.stdout.split() == ["running", sandbox.id], out.stderr
    with sqlite3.connect(agentenv_home / "registry.sqlite3") as conn:  # WAL is a property of the file
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from agentenv.locks import sandbox_lock\n"
         "with sandbox_lock(Path(sys.argv[1]), sys.argv[2], 5):\n print('held', flush=True); time.sleep(30)",
         str(agentenv_home / "locks"), sandbox.id], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SandboxBusy, match="busy"):
            with sandbox_lock(agentenv_home / "locks", sandbox.id, timeout_s=0.3):
                pass
    finally:
        holder.kill()
        holder.wait()
    with sandbox_lock(agentenv_home / "locks", sandbox.id, timeout_s=5):  # released when its holder died
        pass


def test_images_are_tagged_by_content_hash_and_layer_on_base(base_image, tmp_path, monkeypatch):
    recipes = tmp_path / "images"
    (recipes / "base").mkdir(parents=True)
    for f in (ROOT / "sandbox_images" / "base").iterdir():
        (recipes / "base" / f.name).write_bytes(f.read_bytes())
    task = recipes / "hello-task"
    task.mkdir()
    (task / "Dockerfile").write_text("ARG BASE=base\nFROM ${BASE}\nCOPY hello.txt /opt/hello.txt\n")
    (task / "hello.txt").write_text("hello v1\n")
    monkeypatch.setenv("AGENTENV_IMAGES_DIR", str(recipes))
    assert images.tag_of("base") == base_image  # same recipe bytes, same tag: nothing to rebuild
    with pytest.raises(ImageError, match="not built; run `agentenv images build hello-task`"):
        images.resolve("hello-task")
    v1 = images.build("hello-task", quiet=True)
    assert v1.built and v1.parent == "base" and v1.tag.startswith("k3rl/hello-task:")
    assert images.build("hello-task", quiet=True).tag == v1.tag
    (task / "hello.txt").write_text("hello v2\n")
    assert images.tag_of("hello-task") != v1.tag  # changed content, new tag
    api = docker_client.api()
    cid = api.create_container(v1.tag, command=["cat", "/opt/hello.txt"],
                               host_config=api.create_host_config(network_mode="none"))["Id"]
    try:
        api.start(cid)
        api.wait(cid, timeout=30)
        assert api.logs(cid) == b"hello v1\n"
    finally:
        api.remove_container(cid, force=True)
        api.remove_image(v1.tag, force=True)
    with pytest.raises(ImageError, match="no image recipe named"):
        images.build("../base")


@pytest.mark.slow
@pytest.mark.serial  # stops every running container: the other lane's too
def test_a_paused_sandbox_survives_a_dockerd_restart(sandbox, base_image, agentenv_home):
    blockers = restart_blockers(docker_client.api().containers(), agentenv_home)
    # Not a skip: on the machine `make test` runs on, nothing else uses dockerd; stop the other containers
    # (or run this test where none run) rather than lose the check.
    assert not blockers, (f"running container(s) {', '.join(blockers)} are not this test session's nor "
                          "leftovers of a finished one; a dockerd restart would stop them")
    start_counter(sandbox)
    sandbox.pause()
    pid = dockerd_pid()
    cmdline = restart_dockerd(pid, ROOT / "scripts" / "ensure_dockerd.sh")
    new_pid = dockerd_pid()
    assert new_pid != pid
    with open(f"/proc/{new_pid}/cmdline", "rb") as f:
        assert [a.decode() for a in f.read().split(b"\0") if a] == cmdline  # same flags (--experimental)
    assert docker_client.api().version().get("Experimental") is True
    sandbox.resume()
    assert count(sandbox) > 1
    assert sandbox.exec("echo alive").stdout == "alive\n"
