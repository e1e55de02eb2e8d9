"""Files or containers deleted behind AgentENV's back: a typed error that says what is gone and what to
do, a registry that records the sandbox as broken, and one clear line from the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from agentenv_testutil import run_cli

from agentenv import CheckpointError, Sandbox, SandboxStateError
from agentenv.backend import docker_client
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker


def _delete_checkpoint_files(sb: Sandbox) -> str:
    path = runtime().registry.latest_checkpoint(sb.id).path
    shutil.rmtree(path)
    return path


def _assert_broken(sb: Sandbox, why: str) -> None:
    assert sb.status == "broken" and why in sb.reason
    with pytest.raises(SandboxStateError, match="is broken"):
        sb.resume()  # a second try names the recorded reason, no OS error either


def test_resume_without_its_checkpoint_files_is_a_checkpoint_error(sandbox):
    sandbox.pause()
    path = _delete_checkpoint_files(sandbox)
    with pytest.raises(CheckpointError, match=f"checkpoint .* at {path} is gone") as info:
        sandbox.resume()
    assert f"agentenv rm {sandbox.id}" in str(info.value)
    _assert_broken(sandbox, path)
    sandbox.close()
    assert sandbox.status == "closed"


def test_fork_of_a_paused_sandbox_without_its_checkpoint_files(sandbox):
    sandbox.pause()
    path = _delete_checkpoint_files(sandbox)
    before = {s.id for s in Sandbox.list()}
    with pytest.raises(CheckpointError, match="cannot be forked: its checkpoint"):
        sandbox.fork(2)
    assert {s.id for s in Sandbox.list()} == before  # no half-made forks in the registry
    _assert_broken(sandbox, path)


def test_a_paused_sandbox_whose_container_was_removed(sandbox):
    sandbox.pause()
    docker_client.api().remove_container(sandbox.container_id, force=True)
    with pytest.raises(CheckpointError, match="container was removed outside AgentENV"):
        sandbox.resume()
    _assert_broken(sandbox, "removed outside AgentENV")


def test_pausing_a_sandbox_whose_container_was_removed(sandbox):
    docker_client.api().remove_container(sandbox.container_id, force=True)
    with pytest.raises(SandboxStateError, match="cannot be paused: its container was removed"):
        sandbox.pause()
    assert sandbox.status == "broken"


def test_the_cli_says_it_in_one_line(agentenv_home, base_image):
    sid = json.loads(run_cli("create", "--json", "--memory", "128m", "--set", "pids_limit=64").stdout)["id"]
    try:
        assert run_cli("pause", sid).returncode == 0
        _delete_checkpoint_files(Sandbox.get(sid))
        proc = run_cli("resume", sid)
        err = proc.stderr.decode()
        assert proc.returncode != 0
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert "is gone" in err and f"agentenv rm {sid}" in err, err
        assert json.loads(run_cli("stats", sid, "--json").stdout)["state"] == "broken"
    finally:
        assert run_cli("rm", sid).returncode == 0
