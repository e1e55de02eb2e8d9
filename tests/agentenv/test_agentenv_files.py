"""write_file / read_file: round trips, and every way out of the work dir refused."""

from __future__ import annotations

import pytest

from agentenv import PathOutsideWorkspace, SandboxStateError
from agentenv.errors import AgentEnvError

pytestmark = pytest.mark.docker


def test_files_round_trip_with_mode_and_parent_dirs(sandbox):
    blob = bytes(range(256)) * 1000
    sandbox.write_file("deep/dir/blob.bin", blob)
    assert sandbox.read_file("/workspace/deep/dir/blob.bin") == blob
    sandbox.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sandbox.exec("./run.sh").stdout == "ran\n"
    assert sandbox.exec("stat -c %a run.sh").stdout == "755\n"
    sandbox.write_file("run.sh", "short")  # overwrite truncates
    assert sandbox.read_file("run.sh") == b"short"


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "a/../../etc/shadow",
                                  "/workspace/../root/x"])
def test_paths_outside_the_workspace_are_refused(sandbox, path):
    with pytest.raises(PathOutsideWorkspace, match="outside"):
        sandbox.write_file(path, "x")
    with pytest.raises(PathOutsideWorkspace, match="outside"):
        sandbox.read_file(path)


def test_symlinks_out_of_the_workspace_are_refused(sandbox):
    sandbox.exec("ln -s /etc /workspace/etc-link && ln -s /etc/hostname /workspace/host-link")
    with pytest.raises(PathOutsideWorkspace, match="resolves to /etc"):
        sandbox.read_file("host-link")
    with pytest.raises(PathOutsideWorkspace, match="resolves to /etc"):
        sandbox.write_file("etc-link/new", "x")


def test_missing_files_and_paused_sandboxes_give_clear_errors(sandbox):
    with pytest.raises(AgentEnvError, match="no such file"):
        sandbox.read_file("nope.txt")
    sandbox.pause()
    with pytest.raises(SandboxStateError, match="is paused; resume it first"):
        sandbox.read_file("x")
    with pytest.raises(SandboxStateError, match="is paused; resume it first"):
        sandbox.write_file("x", "y")
