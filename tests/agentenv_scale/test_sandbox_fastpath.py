"""The Sandbox API on the fast-path backend: images in the store, deleted with their sandbox, reclaimed by
gc when orphaned, and a disk cap that refuses a pause with a clear error while the sandbox keeps running."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv import Sandbox, SandboxConfig
from agentenv.fastpath import DiskCapExceeded
from agentenv.sandbox import runtime

pytestmark = pytest.mark.docker

COUNTER = (
    "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &"
)


@pytest.fixture
def small_config(agentenv_scale_home) -> SandboxConfig:
    return SandboxConfig.load(memory="128m", pids_limit=64, tmpfs={"/tmp": "size=32m,mode=1777"})


@pytest.fixture
def fast_backend(agentenv_scale_home):
    backend = runtime().backend
    if backend.name != "fastpath":
        pytest.skip(f"the fast path is not this host's backend ({backend.name})")
    return backend


def count(sb: Sandbox) -> int:
    return int(sb.exec("cat /tmp/count").stdout or 0)


def test_images_live_in_the_store_and_go_with_the_sandbox(fast_backend, small_config):
    sb = Sandbox.create(config=small_config)
    try:
        sb.exec(COUNTER)
        while count(sb) < 3:
            pass
        sb.pause()
        st = sb.stats()
        assert st.rss_bytes == 0 and st.pids == 0 and st.checkpoint_bytes > 0
        store = fast_backend.fastpath.store
        record = store.latest(sb.container_id)
        assert record is not None and record.path.is_dir()
        sb.resume()
        count_after_resume = count(sb)
        assert count_after_resume >= 3
        assert store.latest(sb.container_id) is None, "a resume deletes the images it used"
        sb.exec("nohup sleep 900 >/dev/null 2>&1 &")  # started after a restore: the next cycle must work
        sb.pause()
        forks = sb.fork(2)
        assert sb.status == "paused" and all(f.status == "running" for f in forks)
        assert all(count(f) >= count_after_resume for f in forks)
        record = store.latest(sb.container_id)
        assert record is not None
    finally:
        cid = sb.container_id
        sb.close()
        for f in Sandbox.list():
            if f.parent_id == sb.id:
                f.close()
    assert not (store.root / cid).exists(), "closing a sandbox deletes its checkpoint images"


def test_gc_reclaims_images_whose_container_is_gone(fast_backend, small_config):
    from agentenv.gc import collect_garbage

    sb = Sandbox.create(config=small_config)
    sb.pause()
    folder = fast_backend.fastpath.store.container_dir(sb.container_id)
    assert folder.is_dir()
    fast_backend.api.remove_container(sb.container_id, force=True)  # behind AgentENV's back
    # Images no sandbox record points at any more (e.g. a process died between dump and record).
    orphan = fast_backend.fastpath.store.root / ("0" * 64) / "k3rl-orphan"
    orphan.mkdir(parents=True)
    (orphan / "pages-1.img").write_bytes(b"\0" * 4096)
    report = collect_garbage()
    assert sb.status == "closed" and not folder.exists()
    assert str(orphan.parent) in report.removed_checkpoint_copies and not orphan.parent.exists()


def test_disk_cap_refuses_pause_and_the_sandbox_keeps_running(
    tmp_path: Path, monkeypatch, agentenv_scale_home
):
    conf = tmp_path / "fastpath.yaml"
    text = (Path(__file__).resolve().parents[2] / "conf" / "agentenv" / "fastpath.yaml").read_text()
    conf.write_text(text.replace("disk_cap: 32g", "disk_cap: 1m"))
    monkeypatch.setenv("AGENTENV_FASTPATH_CONFIG", str(conf))
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))  # a fresh runtime reads the small cap
    if runtime().backend.name != "fastpath":
        pytest.skip("the fast path is not this host's backend")
    sb = Sandbox.create(config=SandboxConfig.load(memory="128m", tmpfs={"/tmp": "size=32m,mode=1777"}))
    try:
        with pytest.raises(DiskCapExceeded, match="keeps running"):
            sb.pause()
        assert sb.status == "running"
        assert sb.exec("echo still here").stdout == "still here\n"
    finally:
        sb.close()
