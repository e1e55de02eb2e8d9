"""What the server and the pool ask the backend instead of Docker (`SandboxBackend.container_root`,
`workdir_on_host`, `sample`, `find`, `daemon_pids`), on real containers: each answer matches what the
sandbox itself sees, and `find`'s default (for backends without labels) agrees with Docker's label filter.
The container's init is looked up in Docker once per init process, not at each call of an episode."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import docker
import pytest

from agentenv.backend.base import (
    LABEL_HOME,
    LABEL_SANDBOX,
    ContainerNotRunning,
    ContainerRef,
    ResourceSample,
    SandboxBackend,
)
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker


def _ref(sandbox) -> ContainerRef:
    rec = runtime().registry.get_sandbox(sandbox.id)
    return ContainerRef(rec.container, rec.volume)


def test_the_host_sees_the_sandbox_files_where_the_backend_says(sandbox):
    backend, ref = runtime().backend, _ref(sandbox)
    sandbox.write_file("seen.txt", b"from inside")
    root = backend.container_root(ref)
    assert root == Path(f"/proc/{int(root.parent.name)}/root")
    assert (root / "workspace" / "seen.txt").read_bytes() == b"from inside"
    host = backend.workdir_on_host(ref, sandbox.config.workspace)
    assert host == Path(os.path.realpath(host)) and (host / "seen.txt").read_bytes() == b"from inside"
    assert host == Path(os.path.realpath(backend.sandbox_files(ref, rootfs=False)["workdir"]))
    assert backend.workdir_on_host(ref, "/elsewhere") is None

    before = backend.sample(ref, sandbox.config.workspace)
    sandbox.write_file("more.bin", b"x" * 12345)
    after = backend.sample(ref, sandbox.config.workspace)
    assert after.disk_used_bytes - before.disk_used_bytes == 12345
    assert after.disk_total_bytes == shutil.disk_usage(host).total > 0
    assert after.page_cache_bytes >= 0

    sandbox.close()
    with pytest.raises(ContainerNotRunning):
        backend.container_root(ref)
    assert backend.workdir_on_host(ref, sandbox.config.workspace) is None
    assert backend.sample(ref, sandbox.config.workspace) == ResourceSample(0, 0, 0)


def test_a_running_init_is_asked_of_docker_once_and_again_when_it_is_replaced(make_sandbox, monkeypatch):
    sandbox = make_sandbox()
    backend, ref = runtime().backend, _ref(sandbox)
    namespace = backend.network_namespace(ref)
    asked: list[str] = []
    inspect = docker.APIClient.inspect_container

    def counted(api, container):
        asked.append(container)
        return inspect(api, container)

    monkeypatch.setattr(docker.APIClient, "inspect_container", counted)
    assert [backend.network_namespace(ref) for _ in range(3)] == [namespace] * 3
    assert backend.usage(ref)[2] >= 1 and backend.container_root(ref).is_dir()  # pids, the init's root
    assert asked == []  # the kept init still runs: no API round trip
    sandbox.pause()  # the warm runtime keeps the container's init (its shell) through it; others do not
    sandbox.resume()
    ref = _ref(sandbox)
    pid = docker.APIClient().inspect_container(ref.container)["State"]["Pid"]
    assert backend.network_namespace(ref) == os.stat(f"/proc/{pid}/ns/net").st_ino
    assert backend.container_root(ref) == Path(f"/proc/{pid}/root")


def test_find_by_labels_and_its_default_agree(make_sandbox, agentenv_home):
    backend = runtime().backend
    a, b = make_sandbox(), make_sandbox()
    ref_a, ref_b = _ref(a), _ref(b)
    home = {LABEL_HOME: str(agentenv_home)}
    mine = {**home, LABEL_SANDBOX: a.id}
    assert backend.find(mine) == {"containers": [ref_a.container], "volumes": [ref_a.volume]}
    assert backend.find(mine, running_only=True) == {"containers": [ref_a.container], "volumes": []}
    both = backend.find(home, running_only=True)["containers"]
    assert {ref_a.container, ref_b.container} <= set(both)
    assert backend.find({**home, LABEL_SANDBOX: "no-such-sandbox"}) == {"containers": [], "volumes": []}
    assert {ref_a.volume, ref_b.volume} <= set(backend.list_owned(str(agentenv_home))["volumes"])

    # the default every backend gets (list_owned, sandbox_of_container, state) finds the same containers
    assert SandboxBackend.find(backend, mine)["containers"] == [ref_a.container]
    assert sorted(SandboxBackend.find(backend, home, running_only=True)["containers"]) == sorted(both)
    with pytest.raises(NotImplementedError, match="not by"):
        SandboxBackend.find(backend, {**home, "team": "a"})
    with pytest.raises(ValueError, match="at least one label"):
        backend.find({})

    b.pause()
    running = backend.find(home, running_only=True)["containers"]
    assert ref_a.container in running
    assert (ref_b.container in running) == backend.state(ref_b).running  # warm: its shell keeps running
    assert sorted(SandboxBackend.find(backend, home, running_only=True)["containers"]) == sorted(running)


def test_the_backend_names_its_daemons():
    pids = runtime().backend.daemon_pids()
    assert pids, "no dockerd or containerd runs"
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids}
    assert "dockerd" in names and names <= {"dockerd", "containerd"}
