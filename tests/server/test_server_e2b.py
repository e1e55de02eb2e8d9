"""`agentenv serve` driven by the unmodified `e2b` SDK from PyPI (pinned in pyproject.toml): lifecycle,
commands (streams, timeout, background, kill, stdin), files, pause to zero processes and connect with a
process's memory intact, fork, kill, list, TTL expiry, authentication and error shapes; and what a recorded
run of these tests (E2B_COMPAT_RECORD=1, scripts/e2b_compat.py) counts as a test's own SDK calls."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    InvalidArgumentException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize
from e2b.sandbox_sync.filesystem.filesystem import Filesystem

from scripts.e2b_compat import recording

pytestmark = [pytest.mark.docker]
ROOT = Path(__file__).resolve().parents[2]

# Counts in memory; each value is written atomically (no reader ever sees a half-written file).
COUNTER = ("python3 -u -c 'import os, time\nn = 0\nwhile True:\n    n += 1\n    print(n, flush=True)\n"
           "    open(\"/workspace/n.tmp\", \"w\").write(str(n))\n"
           "    os.replace(\"/workspace/n.tmp\", \"/workspace/n\")\n    time.sleep(0.1)'")


def _poll(fn, timeout_s: float, what: str):
    """fn() until it returns a truthy value (bounded in time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _container_state(sandbox_id: str) -> tuple[bool, int]:
    """(running, host pid of init) of the sandbox's container, straight from Docker."""
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=org.k3rl.agentenv.sandbox={sandbox_id}"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 1, f"expected one container for sandbox {sandbox_id}, got {out}"
    info = json.loads(subprocess.run(["docker", "inspect", out[0]], capture_output=True, text=True,
                                     check=True).stdout)[0]["State"]
    return bool(info["Running"]), int(info["Pid"])


def _n(sb) -> int:
    try:
        return int(sb.files.read("n") or 0)
    except FileNotFoundException:
        return 0


def test_commands_through_the_sdk(sdk_sandbox):
    sb = sdk_sandbox(timeout=300, envs={"FROM_CREATE": "yes", "FOO": "create"})
    r = sb.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as failed:
        sb.commands.run("echo partial; exit 7")
    assert failed.value.exit_code == 7 and failed.value.stdout == "partial\n"
    big = sb.commands.run("head -c 3000000 /dev/zero | tr '\\0' a; echo; echo done >&2")
    assert len(big.stdout) == 3000001 and set(big.stdout[:-1]) == {"a"} and big.stderr == "done\n"
    r = sb.commands.run('echo "$FOO $FROM_CREATE"; pwd', envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar yes\n/tmp\n"  # per-command envs over the sandbox's

    # Output streams while the command runs: the first line arrives well before the last.
    events: list[tuple[str, str, float]] = []
    sb.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.4; done",
                    on_stdout=lambda s: events.append(("out", s, time.monotonic())),
                    on_stderr=lambda s: events.append(("err", s, time.monotonic())))
    assert "".join(s for k, s, _ in events if k == "out") == "o1\no2\no3\n"
    assert "".join(s for k, s, _ in events if k == "err") == "e1\ne2\ne3\n"
    outs = [t for k, _, t in events if k == "out"]
    assert outs[-1] - outs[0] > 0.5, "stdout was delivered in one piece, not streamed"

    # A command past its timeout: TimeoutException, and the process is gone.
    with pytest.raises(TimeoutException):
        sb.commands.run("sleep 30; echo never", timeout=1.5)
    _poll(lambda: not [p for p in sb.commands.list() if "sleep 30" in " ".join(p.args)], 10,
          "the timed-out command to be killed")

    # Background command, listed, then killed.
    h = sb.commands.run("sleep 1000", background=True)
    assert h.pid in [p.pid for p in sb.commands.list()]
    assert h.kill() is True
    with pytest.raises(CommandExitException) as killed:
        h.wait()
    assert killed.value.exit_code == 137
    assert h.pid not in [p.pid for p in sb.commands.list()]

    # stdin: send_stdin, then close_stdin for EOF.
    h = sb.commands.run("read line; echo got:$line", background=True, stdin=True)
    sb.commands.send_stdin(h.pid, "hello\n")
    assert h.wait().stdout == "got:hello\n"
    h = sb.commands.run("cat; echo EOF", background=True, stdin=True)
    sb.commands.send_stdin(h.pid, "abc")
    sb.commands.send_stdin(h.pid, "def")
    sb.commands.close_stdin(h.pid)
    assert h.wait().stdout == "abcdefEOF\n"


def test_files_through_the_sdk(sdk_sandbox):
    sb = sdk_sandbox(timeout=300)
    info = sb.files.write("dir/a.txt", "hello file")  # multipart upload, relative to the home /home/user
    assert info.path == "/home/user/dir/a.txt" and info.name == "a.txt" and info.metadata is None
    blob = bytes(range(256)) * 64
    sb.files.write("/workspace/dir/b.bin", blob, gzip=True)  # octet-stream + gzip
    assert sb.files.read("dir/a.txt") == "hello file"
    assert bytes(sb.files.read("dir/b.bin", format="bytes")) == blob
    entries = {e.name: e for e in sb.files.list("dir")}
    assert set(entries) == {"a.txt", "b.bin"} and entries["b.bin"].size == len(blob)
    assert sb.files.make_dir("dir/sub") is True and sb.files.make_dir("dir/sub") is False
    moved = sb.files.rename("dir/a.txt", "dir/sub/c.txt")
    assert moved.path == "/home/user/dir/sub/c.txt" and sb.files.get_info("dir/sub/c.txt").size == 10
    assert sb.files.get_info("/workspace/dir/sub/c.txt").path == "/workspace/dir/sub/c.txt"  # same file
    owned = sb.files.get_info("dir/sub/c.txt")
    assert (owned.owner, owned.group) == ("user", "user")  # the sandbox user's name, as E2B's
    sb.files.remove("dir/sub")
    assert not sb.files.exists("dir/sub/c.txt") and sb.files.exists("dir/b.bin")
    sb.files.remove("dir/sub")  # nothing there any more: succeeds, as envd's remove does
    with pytest.raises(InvalidArgumentException, match="outside the sandbox work dir"):
        sb.files.remove("../etc")  # still confined
    # A relative cwd starts from the sandbox's home; a symlink's target is reported resolved (absolute),
    # as envd does, under the name the path was asked by.
    r = sb.commands.run("ln -s b.bin link && ln -s ../dir up && pwd && whoami && echo $HOME && sudo id -un",
                        cwd="dir")
    assert r.stdout == "/home/user/dir\nuser\n/home/user\nuser\n"
    assert sb.commands.run("pwd").stdout == "/home/user\n"
    link = sb.files.get_info("dir/link")
    assert (link.type.value, link.symlink_target) == ("symlink", "/home/user/dir/b.bin")
    assert sb.files.get_info("/workspace/dir/link").symlink_target == "/workspace/dir/b.bin"
    listed = {e.name: e for e in sb.files.list("dir")}
    assert listed["up"].symlink_target == "/home/user/dir" and listed["b.bin"].symlink_target is None
    # Metadata: user.e2b.* xattrs, set by an upload, replaced by the next, kept by a rename.
    meta = sb.files.write("m.txt", "x", metadata={"author": "k3rl"})
    assert meta.metadata == {"author": "k3rl"} and sb.files.get_info("m.txt").metadata == {"author": "k3rl"}
    assert sb.files.rename("m.txt", "m2.txt").metadata == {"author": "k3rl"}
    assert sb.files.write("m2.txt", "y").metadata is None and sb.files.get_info("m2.txt").metadata is None
    # Signed URLs (the sandbox's envd token signs them; no header needed), refused once expired.
    assert httpx.get(sb.download_url("m2.txt", "user")).content == b"y"
    assert httpx.post(sb.upload_url("up.txt"), content=b"up",
                      headers={"Content-Type": "application/octet-stream"}).status_code == 200
    assert sb.files.read("up.txt") == "up"
    expired = httpx.get(sb.download_url("m2.txt", "user", use_signature_expiration=-60))
    assert (expired.status_code, expired.json()) == (401, {"code": 401, "message": "signature is already "
                                                                                   "expired"})
    forged = httpx.get(sb.download_url("m2.txt", "user").replace("signature=v1_", "signature=v1_x"))
    assert forged.status_code == 401 and "invalid signature" in forged.json()["message"]
    # The only user is `user`: root (or another name) is refused, not run with other rights, saying what the
    # sandbox's processes run with (uid 0 where this host's CRIU cannot dump another uid, as here)
    uid = sb.commands.run("id -u").stdout.strip()
    assert uid in ("0", "1000")
    enforced = (rf"user 'root' is not available \(the sandbox has one user, 'user': uid {uid} with every "
                r"capability dropped, no-new-privileges and a read-only root filesystem; no call runs")
    with pytest.raises(InvalidArgumentException, match=enforced):
        sb.commands.run("id", user="root")
    with pytest.raises(InvalidArgumentException, match=enforced):
        sb.files.read("m2.txt", user="root")
    with pytest.raises(InvalidArgumentException, match=enforced):
        sb.files.list("dir", user="root")
    with pytest.raises(InvalidArgumentException, match="user 'admin' is not available \\(it is not a user"):
        sb.files.list("dir", user="admin")
    assert sb.commands.run("id -u", user="user").exit_code == 0
    with pytest.raises(FileNotFoundException):
        sb.files.read("missing.txt")
    with pytest.raises(InvalidArgumentException, match="outside the sandbox work dir"):
        sb.files.read("/etc/passwd")
    # watch_dir: inotify on the work dir's volume; a recursive watch follows a directory made after it.
    watch = sb.files.watch_dir("dir", recursive=True)
    sb.files.make_dir("dir/new")
    sb.files.write("dir/new/f.txt", "1")
    sb.commands.run("rm dir/new/f.txt")
    sb.commands.run("mkdir -p dir/a/b/c")  # what a new directory holds when it is seen is reported too
    seen = {(e.type.value, e.name) for e in watch.get_new_events()}
    want = {("create", "new"), ("create", "new/f.txt"), ("write", "new/f.txt"), ("remove", "new/f.txt"),
            ("create", "a"), ("create", "a/b"), ("create", "a/b/c")}
    assert want <= seen, seen
    watch.stop()
    with pytest.raises(FileNotFoundException):
        sb.files.watch_dir("no-such-dir")
    term = sb.pty.create(PtySize(rows=24, cols=80))
    assert sb.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):  # killed: the terminal's shell ends with a signal's code
        term.wait()


def test_pause_connect_fork_kill(server, sdk_sandbox, monkeypatch):
    tag = {"lifecycle": uuid.uuid4().hex}  # this test's sandboxes (the source and its forks) in lists
    sb = sdk_sandbox(timeout=300, metadata=tag)
    sb.files.write("note.txt", "kept")
    counter = sb.commands.run(COUNTER, background=True)
    before = _poll(lambda: _n(sb) >= 3 and _n(sb), 20, "the counter to count")
    m = sb.get_metrics()  # one sample, now, from the cgroup and the work dir
    assert len(m) == 1 and 0 < m[0].mem_used < m[0].mem_total and m[0].disk_used >= 4, m
    assert 0 < m[0].cpu_used_pct <= 100 and m[0].disk_total > m[0].disk_used, m
    assert sb.get_metrics(end=datetime.now(UTC) - timedelta(hours=1)) == []  # before it existed
    with pytest.raises(SandboxException, match="filesystem-only pause"):
        sb.pause(keep_memory=False)  # refused, not taken with memory anyway
    term = sb.pty.create(PtySize(rows=24, cols=80), envs={"K": "kept"})  # a terminal across the pause
    sb.pty.send_stdin(term.pid, b"X=$K\n")
    term.disconnect()

    assert sb.pause() is True
    assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
    monkeypatch.setenv("AGENTENV_HOME", str(server.home))
    import agentenv

    stats = agentenv.Sandbox.get(sb.sandbox_id).stats()  # no process of its own: a warm shell at most
    assert stats.pids <= 1 and stats.rss_bytes < 8 * 2**20 and stats.checkpoint_bytes > 0
    assert sb.pause() is False  # 409: already paused
    assert not sb.is_running()
    paused = Sandbox.list(query=SandboxQuery(metadata=tag, state=[SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [sb.sandbox_id]

    sb = Sandbox.connect(sb.sandbox_id, timeout=300)  # resumes it
    assert sb.is_running() and _container_state(sb.sandbox_id)[0]
    after = _n(sb)
    assert after >= before, f"counter restarted: {after} after the pause, {before} before"
    assert counter.pid in [p.pid for p in sb.commands.list()], "the counter process did not survive"
    _poll(lambda: _n(sb) > after + 2, 20, "the counter to go on after connect")
    follow = sb.commands.connect(counter.pid, timeout=20)  # its stdout, from now on
    lines: list[int] = []
    for out, _err, _pty in follow:
        lines += [int(x) for x in (out or "").split()]
        if len(lines) >= 3:
            break
    follow.disconnect()
    assert lines[0] > after and lines == list(range(lines[0], lines[0] + len(lines))), lines
    term = sb.pty.connect(term.pid)  # the same shell, its variable still set; resized, it sees the size
    sb.pty.resize(term.pid, PtySize(rows=30, cols=123))
    sb.pty.send_stdin(term.pid, b"echo $X-$(tput cols)\nexit 3\n")
    screen: list[bytes] = []
    with pytest.raises(CommandExitException):
        term.wait(on_pty=screen.append)
    assert "kept-123" in b"".join(screen).decode(), screen
    end = Sandbox.get_info(sb.sandbox_id).end_at
    assert Sandbox.connect(sb.sandbox_id, timeout=10).sandbox_id == sb.sandbox_id  # running: 200
    assert Sandbox.get_info(sb.sandbox_id).end_at == end, "connect shortened a running sandbox's TTL"
    Sandbox.connect(sb.sandbox_id, timeout=600)
    assert Sandbox.get_info(sb.sandbox_id).end_at > end, "connect did not extend the TTL"

    forks = sb.fork(count=2)
    assert len(forks) == 2 and not [f for f in forks if isinstance(f, Exception)], forks
    try:
        for f in forks:
            assert f.sandbox_id != sb.sandbox_id and f.files.read("note.txt") == "kept"
            assert _n(f) >= after and counter.pid in [p.pid for p in f.commands.list()]
            f.commands.run("echo mine > note.txt")
        assert sb.files.read("note.txt") == "kept"
        _check_list(tag, sb, forks)
    finally:
        for f in forks:
            f.kill()

    # A command followed while its sandbox is killed: the stream breaks off (`unavailable`), the SDK's
    # health probe finds the sandbox gone and raises its not-running error.
    sleeper = sb.commands.run("sleep 60", background=True)
    assert sb.kill() is True
    with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
        sleeper.wait()
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sb.sandbox_id)
    assert Sandbox.kill(sb.sandbox_id) is False  # 404


def test_write_files_kill_by_pid_and_beta_pause(sdk_sandbox):
    """`files.write_files` (several files, text, bytes and a file object, in one upload), `commands.kill`
    by pid, and the deprecated `beta_pause`, which pauses as `pause` does."""
    sb = sdk_sandbox(timeout=300)
    blob = bytes(range(256)) * 16
    infos = sb.files.write_files([{"path": "many/a.txt", "data": "text"},
                                  {"path": "/workspace/many/b.bin", "data": blob},
                                  {"path": "many/sub/c.txt", "data": io.BytesIO(b"from a file object")}])
    assert [i.path for i in infos] == ["/home/user/many/a.txt", "/workspace/many/b.bin",
                                       "/home/user/many/sub/c.txt"], infos
    assert sb.files.read("many/a.txt") == "text" and sb.files.read("many/sub/c.txt") == "from a file object"
    assert bytes(sb.files.read("many/b.bin", format="bytes")) == blob

    sleeper = sb.commands.run("sleep 600", background=True)
    doomed = sb.commands.run("sleep 601", background=True)
    assert sb.commands.kill(doomed.pid) is True
    _poll(lambda: doomed.pid not in [p.pid for p in sb.commands.list()], 10, "the killed command to end")

    assert sb.beta_pause() is True
    assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
    assert Sandbox.beta_pause(sb.sandbox_id) is False  # already paused (the class-method form)
    sb = Sandbox.connect(sb.sandbox_id, timeout=120)
    assert sleeper.pid in [p.pid for p in sb.commands.list()], "the command did not survive beta_pause"
    assert sb.files.read("many/a.txt") == "text"


def test_recording_counts_the_calls_a_test_makes_itself(sdk_sandbox):
    """What a recorded run counts: each public SDK method the test calls, sync or async, and not those the
    SDK calls inside its own methods (`files.write` uploads through `files.write_files`); the SDK's classes
    are as before once the recording ends."""
    sb = sdk_sandbox(timeout=120)
    before = Filesystem.__dict__.get("write")
    calls: list[str] = []
    with recording(calls.append):
        sb.files.write("r.txt", "x")
        assert Sandbox.get_info(sb.sandbox_id).sandbox_id == sb.sandbox_id
        assert asyncio.run(AsyncSandbox.get_info(sb.sandbox_id)).sandbox_id == sb.sandbox_id
    assert calls == ["sync Filesystem.write", "sync Sandbox.get_info", "async Sandbox.get_info"]
    assert Filesystem.__dict__.get("write") is before
    sb.files.read("r.txt")
    assert calls == ["sync Filesystem.write", "sync Sandbox.get_info", "async Sandbox.get_info"]


def _check_list(tag: dict[str, str], sb, forks) -> None:
    """`Sandbox.list` of a source `sb` and its later `forks` (all running, metadata `tag`): newest first
    by default, page by page; `order="asc"`; `started_after` (inclusive) and `template` filter."""
    start = {s.sandbox_id: Sandbox.get_info(s.sandbox_id).started_at for s in (sb, *forks)}
    newest_first = sorted(start, key=lambda i: start[i], reverse=True)
    assert newest_first[-1] == sb.sandbox_id, start

    def ids(**kw) -> list[str]:
        return [s.sandbox_id for s in Sandbox.list(**kw).next_items()]
    pager = Sandbox.list(query=SandboxQuery(metadata=tag, state=[SandboxState.RUNNING]), limit=1)
    pages = []
    while pager.has_next and len(pages) <= len(start):  # bounded: a wrong token must not loop forever
        pages.append([s.sandbox_id for s in pager.next_items()])
    assert pages == [[i] for i in newest_first]
    assert ids(query=SandboxQuery(metadata=tag), order="asc") == newest_first[::-1]
    first = start[sb.sandbox_id]
    assert ids(query=SandboxQuery(metadata=tag, started_after=first)) == newest_first
    later = ids(query=SandboxQuery(metadata=tag, started_after=first + timedelta(microseconds=1)))
    assert later == newest_first[:-1]
    assert ids(query=SandboxQuery(metadata=tag, template="base")) == newest_first
    assert ids(query=SandboxQuery(metadata=tag, template="unknown-template")) == []


def test_snapshots(sdk_sandbox):
    sb = sdk_sandbox(timeout=300)
    sb.files.write("note.txt", "before")
    counter = sb.commands.run(COUNTER, background=True)
    _poll(lambda: _n(sb) >= 3, 20, "the counter to count")
    snap = sb.create_snapshot(name="counting")
    assert snap.names == ["counting"] and sb.is_running()
    sb.files.write("note.txt", "after")
    listed = Sandbox.list_snapshots(sandbox_id=sb.sandbox_id).next_items()
    assert [s.snapshot_id for s in listed] == [snap.snapshot_id]

    for template in (snap.snapshot_id, "counting"):  # by id and by name
        child = sdk_sandbox(template=template, timeout=120)
        assert child.files.read("note.txt") == "before" and _n(child) >= 3
        assert counter.pid in [p.pid for p in child.commands.list()], "the snapshot lost the process"
        assert Sandbox.get_info(child.sandbox_id).template_id == snap.snapshot_id
    with pytest.raises(SandboxException, match="filesystem-only"):
        sb.create_snapshot(mode="filesystem")
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    assert not Sandbox.list_snapshots(sandbox_id=sb.sandbox_id).next_items()


def test_ttl_kills_or_pauses(sdk_sandbox):
    doomed = sdk_sandbox(timeout=2, metadata={"ttl": "kill"})
    napper = sdk_sandbox(timeout=2, metadata={"ttl": "pause"}, lifecycle={"on_timeout": "pause"})
    listed = Sandbox.list(query=SandboxQuery(metadata={"ttl": "pause"})).next_items()
    assert {s.sandbox_id for s in listed} == {napper.sandbox_id}

    def gone() -> bool:
        try:
            Sandbox.get_info(doomed.sandbox_id)
            return False
        except SandboxNotFoundException:
            return True
    _poll(gone, 20, "the sandbox without autoPause to be killed at its TTL")
    _poll(lambda: Sandbox.get_info(napper.sandbox_id).state.value == "paused", 20,
          "the autoPause sandbox to be paused at its TTL")
    napper = Sandbox.connect(napper.sandbox_id, timeout=300)
    assert napper.commands.run("echo awake").stdout == "awake\n"
    napper.set_timeout(1)
    _poll(lambda: Sandbox.get_info(napper.sandbox_id).state.value == "paused", 20, "the second TTL pause")


def test_auth_and_error_shapes(server, sdk_sandbox):
    for headers in ({}, {"X-API-Key": "e2b_" + "0" * 40}):
        r = httpx.get(server.url + "/v2/sandboxes", headers=headers)
        assert r.status_code == 401 and r.json()["code"] == 401 and "API key" in r.json()["message"]
    with pytest.raises(AuthenticationException):
        Sandbox.create("base", api_key="e2b_" + "0" * 40)

    key = {"X-API-Key": server.api_key}
    for body, needle in (({"templateID": "no-such-image"}, "no-such-image"),
                         ({"templateID": "base", "timeout": -1}, "timeout"),
                         ({"timeout": 5}, "templateID"),
                         ({"templateID": "base", "allow_internet_access": True}, "not supported"),
                         ({"templateID": "base", "mcp": {"x": {}}}, "mcp"),
                         ({"templateID": "base", "autoPauseMemory": False}, "autoPauseMemory=false")):
        r = httpx.post(server.url + "/v2/sandboxes", json=body, headers=key)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["code"] == 400 and needle in r.json()["message"], r.json()
    r = httpx.post(server.url + "/v2/sandboxes", content=b"{not json", headers=key)
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.put(server.url + "/sandboxes", headers=key)
    assert r.status_code == 405 and r.json() == {"code": 405, "message": "PUT is not allowed on /sandboxes; "
                                                                          "use GET, POST"}
    r = httpx.get(server.url + "/templates", headers=key)
    assert r.status_code == 501 and "not supported" in r.json()["message"]
    r = httpx.get(server.url + "/sandboxes/nope", headers=key)
    assert r.status_code == 404 and r.json() == {"code": 404, "message": "sandbox 'nope' not found"}

    sb = sdk_sandbox(timeout=120)
    with pytest.raises(SandboxException, match="not supported"):
        sb.update_network({"deny_out": ["0.0.0.0/0"]})  # an SDK call without a server side: E2B-shaped 501
    r = httpx.post(f"{server.url}/sandboxes/{sb.sandbox_id}/connect", json={"timeout": 60, "memory": False},
                   headers=key)
    assert r.status_code == 400 and "memory=false" in r.json()["message"], r.text
    # The data plane wants the sandbox's own envd token.
    rpc = {"E2b-Sandbox-Id": sb.sandbox_id, "Content-Type": "application/json"}
    r = httpx.post(server.url + "/process.Process/List", content=b"{}", headers=rpc)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.get(server.url + "/files", params={"path": "x"},
                  headers={"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": "wrong"})
    assert r.status_code == 401 and r.json()["code"] == 401

    # Bodies over max_body_bytes are refused by their Content-Length before being read.
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: " + server.api_key.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{}")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413"), head


def test_async_sdk(server):
    """The SDK's asyncio client speaks the same protocol: create, run with streaming, files, kill."""
    async def main() -> None:
        sb = await AsyncSandbox.create("base", timeout=120)
        try:
            seen: list[str] = []
            r = await sb.commands.run("echo a; sleep 0.3; echo b", on_stdout=seen.append)
            assert r.stdout == "a\nb\n" and "".join(seen) == "a\nb\n"
            events: list = []
            watch = await sb.files.watch_dir("/home/user/", events.append, include_entry=True)  # WatchDir
            await sb.files.write("async.txt", "x")
            assert await sb.files.read("async.txt") == "x"
            for _ in range(100):
                if any(e.type.value == "write" and e.name == "async.txt" for e in events):
                    break
                await asyncio.sleep(0.05)
            await watch.stop()
            write = next(e for e in events if e.type.value == "write" and e.name == "async.txt")
            assert write.entry.path == "/home/user/async.txt" and write.entry.size == 1
        finally:
            assert await sb.kill() is True
    asyncio.run(main())


def test_serve_refuses_a_busy_port(server):
    """`agentenv serve` on a port in use (the test server's own): one line on stderr, exit 1."""
    port = server.url.rsplit(":", 1)[1]
    env = {**os.environ, "AGENTENV_HOME": str(server.home)}
    r = subprocess.run([sys.executable, "-m", "agentenv.cli", "serve", "--port", port], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == \
        f"agentenv: error: cannot listen on 127.0.0.1:{port}: Address already in use (choose another " \
        "--host/--port)"
