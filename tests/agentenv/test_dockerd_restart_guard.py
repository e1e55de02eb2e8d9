"""Which running containers keep the dockerd-restart test from running (no daemon needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dockerd_restart import STALE_AFTER_S, TEST_LABEL, hold_session_lock, restart_blockers

from agentenv.backend.base import LABEL_HOME


def _row(cid: str, labels: dict[str, str] | None = None, created: float | None = None) -> dict:
    return {"Id": cid * 12, "Labels": labels, "Created": created if created is not None else time.time()}


def _test_home(tmp_path: Path, name: str, age_s: float | None) -> Path:
    """A test session's home under a pytest-of-* folder; its registry last changed `age_s` ago."""
    home = tmp_path / "pytest-of-ci" / "pytest-7" / name
    home.mkdir(parents=True)
    if age_s is not None:
        reg = home / "registry.sqlite3"
        reg.write_bytes(b"")
        t = time.time() - age_s
        os.utime(reg, (t, t))
    return home


def test_only_foreign_or_live_containers_block_a_restart(tmp_path):
    own = _test_home(tmp_path, "agentenv-home0", age_s=0)
    finished = _test_home(tmp_path, "agentenv-home1", age_s=None)
    os.close(hold_session_lock(finished))  # a lock file nobody holds any more: its session is over
    live_locked = _test_home(tmp_path, "agentenv-home2", age_s=STALE_AFTER_S * 2)
    fd = hold_session_lock(live_locked)
    busy_unlocked = _test_home(tmp_path, "agentenv-home-tasks0", age_s=5)
    idle_unlocked = _test_home(tmp_path, "agentenv-home-tasks1", age_s=STALE_AFTER_S * 2)
    try:
        rows = [
            _row("a", {LABEL_HOME: str(own)}),
            _row("b", {LABEL_HOME: str(finished)}),
            _row("c", {LABEL_HOME: str(tmp_path / "pytest-of-ci" / "pytest-1" / "agentenv-home9")}),  # gone
            _row("d", {LABEL_HOME: str(idle_unlocked)}),
            _row("e", {TEST_LABEL: "agentenv_scale"}, created=time.time() - STALE_AFTER_S * 2),
            _row("f", {LABEL_HOME: str(live_locked)}),  # a concurrent live session
            _row("g", {LABEL_HOME: str(busy_unlocked)}),  # another suite, registry in use
            _row("h", {LABEL_HOME: "/home/user/.local/share/agentenv"}),  # a user's real sandbox
            _row("i", None),  # somebody else's container
            _row("j", {TEST_LABEL: "agentenv_scale"}),  # a young scale-test container
        ]
        assert restart_blockers(rows, own) == ["f" * 12, "g" * 12, "h" * 12, "i" * 12, "j" * 12]
    finally:
        os.close(fd)
    assert "f" * 12 not in restart_blockers(rows, own)  # its session ended
