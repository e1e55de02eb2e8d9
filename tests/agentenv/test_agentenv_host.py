"""Host-level behaviour: the CRIU uid probe, dockerd restarting under a paused sandbox, the registry
shared across processes, and content-hashed images."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from agentenv_testutil import ROOT, count, start_counter

from agentenv import images
from agentenv.backend import docker_client
from agentenv.backend.docker_criu import cap_sys_resource_in_bounding_set
from agentenv.errors import ImageError, SandboxBusy
from agentenv.locks import sandbox_lock
from agentenv.sandbox import runtime

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


def _dockerd_pid() -> int:
    """The dockerd serving $DOCKER_HOST (the default socket when unset)."""
    sock = docker_client.daemon_url().removeprefix("unix://")
    candidates = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout.split()
    for pid in map(int, candidates):
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        hosts = [a.decode().removeprefix("unix://") for i, a in enumerate(args)
                 if i and args[i - 1] in (b"-H", b"--host")]
        hosts += [a.decode().split("=", 1)[1].removeprefix("unix://")
                  for a in args if a.startswith(b"--host=")]
        if sock in hosts or (not hosts and sock == "/var/run/docker.sock"):
            return pid
    raise AssertionError(f"no dockerd process serves {sock}")


def _restart_dockerd(pid: int) -> None:
    """Stop the daemon and start it again with the same command line; make sure it answers after."""
    cmdline = [a.decode() for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") if a]
    log = open(os.environ.get("K3RL_LOG_DIR", "/var/log/k3rl") + "/dockerd.log", "ab")
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{pid}"), "dockerd did not stop within 60 s"
    finally:
        subprocess.Popen(cmdline, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:  # last resort for the default daemon
                subprocess.run(["bash", str(ROOT / "scripts" / "ensure_dockerd.sh")], check=True, timeout=120)
                break
            time.sleep(0.3)
        docker_client.reset()


@pytest.mark.slow
def test_a_paused_sandbox_survives_a_dockerd_restart(sandbox, base_image):
    api = docker_client.api()
    foreign = [c for c in api.containers() if c["Id"] != sandbox.container_id]
    if foreign:
        pytest.skip(f"{len(foreign)} other running container(s) would be stopped by a dockerd restart "
                    "(others share this daemon); runs where only this suite uses the daemon")
    start_counter(sandbox)
    sandbox.pause()
    pid = _dockerd_pid()
    _restart_dockerd(pid)
    assert _dockerd_pid() != pid
    sandbox.resume()
    assert count(sandbox) > 1
    assert sandbox.exec("echo alive").stdout == "alive\n"
