"""`agentenv --server URL ...`: every sandbox verb of the CLI against a running `agentenv serve` (the
session's `server` fixture), each run as its own subprocess, as a user on another machine would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from netns_hosts import ROOT


def cli(server, *argv: str, stdin: bytes | None = None, env: dict | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """`agentenv --server URL argv...` with the server's API key; the caller's own home is empty, so a
    verb that silently acted locally instead of remotely finds nothing."""
    base = {k: v for k, v in os.environ.items() if k not in ("AGENTENV_SERVER", "AGENTENV_HOME")}
    full_env = {**base, "AGENTENV_API_KEY": server.api_key, "AGENTENV_HOME": str(server.home / "client"),
                **(env or {})}
    args = [sys.executable, "-m", "agentenv.cli", *(["--server", server.url] if "AGENTENV_SERVER" not in
                                                    (env or {}) else []), *argv]
    p = subprocess.run(args, input=stdin, capture_output=True, env=full_env, cwd=ROOT, timeout=180)
    if check:
        assert p.returncode == 0, (argv, p.returncode, p.stderr.decode())
    return p


def _wait_line(server, sid: str, path: str, deadline_s: float = 20.0) -> str:
    """The first non-empty content of `path` in the sandbox (bounded wait)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = cli(server, "exec", sid, "--", "cat", path, check=False).stdout.decode().strip()
        if out:
            return out
        time.sleep(0.3)
    raise AssertionError(f"{path} stayed empty in sandbox {sid}")


def test_remote_cli_verbs_and_memory_across_pause_resume_fork(server, tmp_path):
    sid = cli(server, "create", "--image", "base", "--label", "who=cli-test").stdout.decode().strip()
    made = [sid]
    try:
        listed = json.loads(cli(server, "ls", "--json").stdout)
        row = next(r for r in listed if r["id"] == sid)
        assert row["state"] == "running" and row["labels"]["who"] == "cli-test"
        assert row["host"] == server.url

        p = cli(server, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7", check=False)
        assert (p.returncode, p.stdout, p.stderr) == (7, b"out\n", b"err\n")
        p = cli(server, "exec", sid, "--timeout", "1", "--", "sleep", "30", check=False)
        assert p.returncode == 124 and b"timed out" in p.stderr
        assert cli(server, "exec", sid, "-i", "--", "wc", "-c", stdin=b"12345").stdout.strip() == b"5"

        local = tmp_path / "blob.bin"
        local.write_bytes(bytes(range(256)) * 40)
        cli(server, "put", sid, str(local), "data/blob.bin")
        assert cli(server, "get", sid, "data/blob.bin").stdout == local.read_bytes()
        p = cli(server, "get", sid, "../etc/passwd", check=False)
        assert p.returncode == 1 and b"outside the sandbox work dir" in p.stderr

        # A process whose only copy of a secret is in its memory: the file is gone once it has read it.
        cli(server, "put", sid, "-", "secret", stdin=b"s3cr3t\n")
        cli(server, "exec", sid, "--", "sh", "-c",
            "(read s < secret; rm secret; i=0; while :; do i=$((i+1)); echo \"$s $i\" > tick.tmp; "
            "mv tick.tmp tick; sleep 0.2; done) > /dev/null 2>&1 &")
        before = _wait_line(server, sid, "tick")
        assert before.startswith("s3cr3t ")

        assert cli(server, "pause", sid).stdout.decode().split() == [sid, "paused"]
        stats = json.loads(cli(server, "stats", sid, "--json").stdout)
        assert stats["state"] == "paused" and stats["rss_bytes"] < 8 * 2**20 and stats["checkpoint_bytes"] > 0
        p = cli(server, "exec", sid, "--", "true", check=False)
        assert p.returncode == 1 and b"paused" in p.stderr

        assert cli(server, "resume", sid).stdout.decode().split() == [sid, "running"]
        time.sleep(0.6)
        after = _wait_line(server, sid, "tick")
        secret, n = after.split()
        assert secret == "s3cr3t" and int(n) > int(before.split()[1])
        assert cli(server, "exec", sid, "--", "test", "-e", "secret", check=False).returncode == 1

        forks = json.loads(cli(server, "fork", sid, "-n", "2", "--json").stdout)
        made += [f["id"] for f in forks]
        assert len(forks) == 2 and all(f["parent"] == sid and f["state"] == "running" for f in forks)
        for f in forks:
            time.sleep(0.3)
            secret, n = _wait_line(server, f["id"], "tick").split()
            assert secret == "s3cr3t" and int(n) >= 1

        info = json.loads(cli(server, "info", "--json").stdout)
        assert info["server"] == server.url and info["memAvailableBytes"] > 0 and info["running"] >= 3

        p = cli(server, "rm", *made, "no-such-sandbox", check=False)
        assert p.returncode == 1 and b"no sandbox 'no-such-sandbox'" in p.stderr
        assert sorted(p.stdout.decode().split()) == sorted([*made, *["closed"] * len(made)])
        made = []
        assert not {r["id"] for r in json.loads(cli(server, "ls", "--json").stdout)} & {sid}
    finally:
        if made:
            cli(server, "rm", *made, check=False)


def test_remote_cli_env_var_refusals_and_unreachable_host(server):
    # $AGENTENV_SERVER is the same as --server.
    p = cli(server, "info", "--json", env={"AGENTENV_SERVER": server.url})
    assert json.loads(p.stdout)["server"] == server.url
    for verb in (["images", "build"], ["gc"], ["serve"]):
        p = cli(server, *verb, check=False)
        assert p.returncode == 1 and b"has no remote form" in p.stderr, verb
    p = cli(server, "create", "--memory", "1g", check=False)
    assert p.returncode == 1 and b"host's sandbox config" in p.stderr
    p = cli(server, "ls", env={"AGENTENV_API_KEY": "wrong"}, check=False)
    assert p.returncode == 1 and b"invalid API key" in p.stderr
    started = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "agentenv.cli", "--server", "http://127.0.0.1:9", "ls"],
                       capture_output=True, env={**os.environ, "AGENTENV_API_KEY": "k"}, cwd=ROOT, timeout=60)
    assert p.returncode == 1 and b"did not answer" in p.stderr and len(p.stderr.splitlines()) == 1
    assert time.monotonic() - started < 30
