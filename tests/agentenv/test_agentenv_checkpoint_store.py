"""The one checkpoint store under the Sandbox API: images live in `store_dir` on local disk, forks of one
checkpoint share its page images, images go with their sandbox and are reclaimed by gc when orphaned,
and a disk cap refuses a pause with a clear error while the sandbox keeps running."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from agentenv_testutil import SMALL, count, start_counter

from agentenv import Sandbox, SandboxConfig
from agentenv.backend.errors import DiskCapExceeded
from agentenv.backend.host import check_store_dir, filesystem_type
from agentenv.backend.store import disk_bytes
from agentenv.errors import ConfigError
from agentenv.gc import collect_garbage
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker


def _page_inodes(folder: Path) -> set[int]:
    return {p.stat().st_ino for p in folder.glob("pages-*.img")}


def _stored_bytes(store, sandboxes) -> int:
    """Bytes the store holds for these sandboxes' containers (not `store.usage()`: the store is shared by
    every sandbox on the host, and another test's pauses land in it meanwhile)."""
    folders = [store.container_dir(sb.container_id) for sb in sandboxes]
    return sum(disk_bytes(folder) for folder in folders if folder.exists())


def test_images_live_in_the_store_and_go_with_the_sandbox(sandbox):
    store = runtime().backend.store
    start_counter(sandbox)
    sandbox.pause()
    st = sandbox.stats()
    assert st.rss_bytes < 8 * 2**20 and st.pids <= 1 and st.checkpoint_bytes > 0  # a warm shell at most
    record = store.latest(sandbox.container_id)
    assert record is not None and record.path.is_dir()
    assert filesystem_type(record.path) not in ("tmpfs", "ramfs")
    assert runtime().registry.latest_checkpoint(sandbox.id).path == str(record.path)
    sandbox.resume()
    after = count(sandbox)
    assert store.latest(sandbox.container_id) is None, "a resume deletes the images it used"
    sandbox.exec("nohup sleep 900 >/dev/null 2>&1 &")  # started after a restore: the next cycle must work
    sandbox.pause()
    record = store.latest(sandbox.container_id)
    inodes, used = _page_inodes(record.path), _stored_bytes(store, [sandbox])
    forks = sandbox.fork(3)
    assert sandbox.status == "paused" and all(count(f) >= after for f in forks)
    # The forks restored from the template's own page images: no copy was left or made per fork.
    assert _page_inodes(record.path) == inodes and _stored_bytes(store, [sandbox, *forks]) <= used + 3 * 2**20
    cid = sandbox.container_id
    sandbox.close()
    assert not store.container_dir(cid).exists(), "closing a sandbox deletes its checkpoint images"


def test_gc_reclaims_images_whose_container_is_gone(sandbox):
    backend = runtime().backend
    sandbox.pause()
    folder = backend.store.container_dir(sandbox.container_id)
    assert folder.is_dir()
    backend.api.remove_container(sandbox.container_id, force=True)  # behind AgentENV's back
    # Images no container owns any more (e.g. a process died between the dump and the registry).
    orphan = backend.store.root / ("0" * 64) / "k3rl-orphan"
    orphan.mkdir(parents=True)
    (orphan / "pages-1.img").write_bytes(b"\0" * 4096)
    report = collect_garbage()
    assert sandbox.status == "closed" and not folder.exists()
    assert str(orphan.parent) in report.removed_checkpoint_copies and not orphan.parent.exists()


def test_disk_cap_refuses_pause_and_the_sandbox_keeps_running(tmp_path: Path, monkeypatch, base_image):
    conf = tmp_path / "backend.yaml"
    text = (Path(__file__).resolve().parents[2] / "conf" / "agentenv" / "backend.yaml").read_text()
    assert "disk_cap: 32g" in text
    conf.write_text(text.replace("disk_cap: 32g", "disk_cap: 1m"))
    monkeypatch.setenv("AGENTENV_BACKEND_CONFIG", str(conf))
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))  # a fresh runtime reads the small cap
    sb = Sandbox.create(config=SandboxConfig.load(**SMALL))
    try:
        with pytest.raises(DiskCapExceeded, match="keeps running"):
            sb.pause()
        assert sb.status == "running"
        assert sb.exec("echo still here").stdout == "still here\n"
    finally:
        sb.close()


def test_a_store_on_tmpfs_is_refused():
    shm = Path("/dev/shm")
    assert filesystem_type(shm) == "tmpfs", "this host mounts no tmpfs at /dev/shm"
    assert os.path.isdir(shm)
    with pytest.raises(ConfigError, match="tmpfs"):
        check_store_dir(shm / "agentenv-images")


def test_usage_and_deletion_survive_folders_removed_meanwhile(tmp_path, monkeypatch):
    """Another process removing a sandbox deletes its folder while this one sums the store (a pause's
    cap check); a deleted checkpoint is forgotten at once and its images are gone once usage() returns."""
    from agentenv.backend.store import CheckpointStore, ImageRecord

    store = CheckpointStore(tmp_path / "store", cap=2**30)
    with store.reserve("live", 4096) as path:
        (path / "pages-1.img").write_bytes(b"x" * 8192)
    record = ImageRecord(container_id="live", name=path.name, path=path, created=1.0, image_bytes=8192,
                         processes=())
    store.save(record)
    listed = store.container_ids
    monkeypatch.setattr(store, "container_ids", lambda: [*listed(), "removed-meanwhile"])
    assert store.usage() >= 8192
    store.delete(record)
    assert store.records("live") == []  # forgotten at once
    assert store.usage() < 8192 and not path.exists()  # usage() waited for the images to go
