"""`agentenv.backend.shell_files.sweep_scratch`: a restore's work folder left over by a killed process goes
at the next runtime start; a recent one, one a running page daemon still names and other files stay."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from agentenv.backend.shell_files import prepare_runtime_files, sweep_scratch


def aged(path, seconds: float):
    path.mkdir()
    (path / "restore.log").write_text("log")
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_left_over_restore_folders_go_and_those_in_use_or_recent_stay(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    left = aged(scratch / "restore-0123456789ab", 7200)
    recent = aged(scratch / "restore-aaaaaaaaaaaa", 60)
    served = aged(scratch / "restore-bbbbbbbbbbbb", 7200)
    other = aged(scratch / "keep-me", 7200)
    # a process whose command line names the folder as CRIU's page daemon does (`-W FOLDER`)
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-W", str(served)])
    cmdline = Path(f"/proc/{daemon.pid}/cmdline")
    deadline = time.monotonic() + 10  # the new program's arguments appear a moment after exec returns
    while str(served).encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert sweep_scratch(scratch) == [left]
        assert not left.exists() and recent.is_dir() and served.is_dir() and other.is_dir()
    finally:
        daemon.kill()
        daemon.wait()
    assert sweep_scratch(scratch) == [served]
    assert sweep_scratch(scratch, stale_after_s=0) == [recent]
    assert other.is_dir()


def test_the_runtime_start_sweeps(tmp_path, monkeypatch):
    scratch = tmp_path / "runtime" / "scratch"
    scratch.mkdir(parents=True)
    left = aged(scratch / "restore-0123456789ab", 7200)
    monkeypatch.setattr("agentenv.backend.shell_files._init_binary", lambda d: d / "init")
    monkeypatch.setattr("agentenv.backend.shell_files._kdat", lambda d: None)
    files = prepare_runtime_files(tmp_path / "runtime")
    assert files.scratch == scratch and not left.exists()
