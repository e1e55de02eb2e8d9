"""The `agentenv` CLI in subprocesses: the create → exec → pause → stats → resume → exec transcript,
--json shapes, exit codes, one-line errors for every bad input, concurrent pauses, gc."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentenv.backend import docker_client

pytestmark = pytest.mark.docker


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def one_line_error(proc: subprocess.CompletedProcess, expected: str) -> str:
    err = proc.stderr.decode()
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("agentenv") and "error:" in err and expected in err, err
    return err


@pytest.fixture
def created(cli, base_image):
    sid = json.loads(ok(cli("create", "--json", "--memory", "128m", "--set", "pids_limit=64")))["id"]
    yield sid
    cli("rm", sid)


def test_transcript_state_survives_pause_and_resume(cli, created):
    sid = created
    ok(cli("exec", sid, "--", "sh", "-c", "echo 41 > /tmp/value; nohup sleep 1000 >/dev/null 2>&1 &"))
    assert json.loads(ok(cli("pause", sid, "--json"))) == [{"id": sid, "state": "paused"}]
    stats = json.loads(ok(cli("stats", sid, "--json")))
    assert stats["state"] == "paused" and stats["rss_bytes"] < 8 * 2**20 and stats["checkpoint_bytes"] > 0
    assert {"id", "state", "rss_bytes", "cpu_seconds", "checkpoint_bytes"} <= set(stats)
    assert "paused" in ok(cli("stats", sid))  # the human table
    ok(cli("resume", sid))
    script = "echo $(( $(cat /tmp/value) + 1 )); ps -eo args | grep -c '^sleep 1000$'"
    out = ok(cli("exec", sid, "--", "sh", "-c", script))
    assert out == "42\n1\n"
    assert json.loads(ok(cli("stats", sid, "--json")))["rss_bytes"] > 0


def test_exec_propagates_exit_codes_and_json(cli, created):
    assert cli("exec", created, "--", "sh", "-c", "exit 7").returncode == 7
    r = cli("exec", created, "--json", "--", "sh", "-c", "echo out; echo err >&2")
    assert json.loads(r.stdout) | {"duration_s": 0} == {"exit_code": 0, "stdout": "out\n", "stderr": "err\n",
                                                        "duration_s": 0, "timed_out": False,
                                                        "truncated": False, "oom_killed": False}
    slow = cli("exec", created, "--timeout", "0.5", "--", "sleep", "10")
    assert slow.returncode == 124 and b"timed out" in slow.stderr
    assert ok(cli("exec", created, "-i", "--", "wc", "-c", stdin=b"12345")).strip() == "5"


def test_files_ls_and_fork_through_the_cli(cli, created, tmp_path):
    local = tmp_path / "in.txt"
    local.write_text("payload")
    ok(cli("put", created, str(local), "dir/in.txt"))
    assert ok(cli("get", created, "dir/in.txt")) == "payload"
    forks = json.loads(ok(cli("fork", created, "-n", "2", "--json")))
    assert len(forks) == 2 and all(f["parent"] == created and f["state"] == "running" for f in forks)
    listed = {s["id"]: s for s in json.loads(ok(cli("ls", "--json")))}
    assert {created, *(f["id"] for f in forks)} <= set(listed)
    assert ok(cli("get", forks[1]["id"], "dir/in.txt")) == "payload"
    ok(cli("rm", *(f["id"] for f in forks)))
    assert all(f["id"] not in {s["id"] for s in json.loads(ok(cli("ls", "--json")))} for f in forks)


@pytest.mark.parametrize("args, expected", [
    (("exec", "0badc0de0bad", "--", "true"), "no sandbox '0badc0de0bad'"),
    (("pause", "0badc0de0bad"), "no sandbox"),
    (("stats", "zz"), "no sandbox"),
    (("create", "--image", "no-such-image"), "no image 'no-such-image'"),
    (("create", "--set", "memroy=1g"), "sandbox config: unknown key"),
    (("create", "--memory", "lots"), "memory"),
    (("frobnicate",), "invalid choice"),
    (("fork", "x"), "required: -n"),
    (("images", "build", "nope"), "no image recipe named 'nope'"),
])
def test_bad_input_gets_one_clear_line_and_a_non_zero_exit(cli, base_image, args, expected):
    one_line_error(cli(*args), expected)


def test_no_daemon_is_one_line_that_says_what_to_do(cli, tmp_path):
    err = one_line_error(cli("create", env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"}),
                         f"no Docker daemon answers at unix://{tmp_path}/none.sock")
    assert "make bootstrap" in err


def test_bad_input_on_a_real_sandbox(cli, created, tmp_path):
    one_line_error(cli("put", created, "-", "../escape", stdin=b"x"), "outside the sandbox work dir")
    one_line_error(cli("put", created, str(tmp_path / "missing"), "x"), "cannot read local file")
    one_line_error(cli("get", created, "/etc/passwd"), "outside the sandbox work dir")
    one_line_error(cli("fork", created, "-n", "0"), "fork count")
    one_line_error(cli("exec", created), "exec needs a command")
    ok(cli("pause", created))
    one_line_error(cli("pause", created), f"sandbox {created} is already paused")
    one_line_error(cli("exec", created, "--", "true"), f"sandbox {created} is paused; resume it first")


def test_two_processes_pausing_at_once_leave_one_paused_sandbox(cli, created):
    cmd = [sys.executable, "-m", "agentenv.cli", "pause", created]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]
    codes = sorted(code for code, _ in outs)
    assert codes == [0, 1], outs
    loser = next(err for code, err in outs if code == 1)
    assert "already paused" in loser and loser.count("\n") == 1
    assert json.loads(ok(cli("stats", created, "--json")))["state"] == "paused"
    ok(cli("resume", created))


def test_gc_reconciles_the_registry_with_docker(cli, created, agentenv_home, base_image):
    api = docker_client.api()
    # a container labelled as this registry's that no sandbox knows (e.g. its creator crashed)
    stray = api.create_container(base_image, command=["true"],
                                 labels={"org.k3rl.agentenv.home": str(agentenv_home.resolve())})
    # a sandbox whose container vanished behind AgentENV's back
    victim = next(s for s in json.loads(ok(cli("ls", "--json"))) if s["id"] == created)
    api.remove_container(victim["container"], force=True)
    report = json.loads(ok(cli("gc", "--json")))
    assert stray["Id"][:12] in report["removed_containers"]
    assert created in report["closed"]
    assert json.loads(ok(cli("stats", created, "--json")))["state"] == "closed"
    assert json.loads(ok(cli("gc", "--json")))["removed_containers"] == []


def test_images_ls_and_info(cli, base_image):
    rows = json.loads(ok(cli("images", "ls", "--json")))
    base = next(r for r in rows if r["name"] == "base")
    assert base["built"] and base["tag"] == base_image
    # unchanged content hash: returns the existing tag without rebuilding
    assert ok(cli("images", "build", "base", "--quiet")).strip() == base_image
    info = json.loads(ok(cli("info", "--json")))
    assert info["sandbox_user"] in ("agent", "root") and info["experimental"] is True
