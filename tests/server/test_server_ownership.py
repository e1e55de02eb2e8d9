"""`agentenv serve` removes only what it provably made: sandboxes labelled with its home's server id. A fork
made with the CLI from a served sandbox is not the server's and survives its restarts; a server started on
a home whose `e2b.sqlite3` was deleted removes nothing and serves every sandbox again (rows rebuilt from the
sandboxes' labels)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netns_hosts import ROOT
from test_server_faults import CALL_TIMEOUT_S, _listed, _sdk, served  # noqa: F401 - `served`: the fixture

pytestmark = pytest.mark.docker


def _cli(srv, *args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "agentenv.cli", *args], env=srv.env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_a_cli_fork_of_a_served_sandbox_survives_a_server_restart(served):  # noqa: F811
    sbx = _sdk().create("base", timeout=600, metadata={"who": "served"}, request_timeout=CALL_TIMEOUT_S)
    sbx.files.write("mark.txt", "from the source\n", request_timeout=CALL_TIMEOUT_S)
    [fork] = _cli(served, "fork", sbx.sandbox_id, "-n", "1").split()
    served.kill9()
    served.start()
    assert _cli(served, "exec", fork, "--", "cat", "mark.txt") == "from the source\n"
    assert fork not in _listed()  # not the server's: its API does not serve it
    served.stop()  # a clean stop and start: still there
    served.start()
    assert _cli(served, "exec", fork, "--", "cat", "mark.txt") == "from the source\n"
    _cli(served, "rm", fork)
    sbx.kill(request_timeout=CALL_TIMEOUT_S)


def test_a_server_on_a_home_whose_store_was_deleted_removes_nothing(served):  # noqa: F811
    S = _sdk()
    running = S.create("base", timeout=600, metadata={"role": "running"}, envs={"GREETING": "hello"},
                       request_timeout=CALL_TIMEOUT_S)
    paused = S.create("base", timeout=600, metadata={"role": "paused"}, request_timeout=CALL_TIMEOUT_S)
    for sbx in (running, paused):
        sbx.files.write("mark.txt", sbx.sandbox_id, request_timeout=CALL_TIMEOUT_S)
    snap = running.create_snapshot(name="kept", request_timeout=CALL_TIMEOUT_S)
    paused.pause(request_timeout=CALL_TIMEOUT_S)
    rows_before = served.live_rows()
    served.stop()
    for name in ("e2b.sqlite3", "e2b.sqlite3-wal", "e2b.sqlite3-shm"):
        (served.home / name).unlink(missing_ok=True)
    served.start()
    assert served.live_rows() == rows_before, served.log.read_text()[-3000:]
    assert "rebuilt from the sandboxes' labels" in served.log.read_text()
    listed = _listed()
    assert listed.get(running.sandbox_id) == "running" and listed.get(paused.sandbox_id) == "paused", listed
    info = S.get_info(paused.sandbox_id, request_timeout=CALL_TIMEOUT_S)
    assert info.metadata == {"role": "paused"} and info.template_id == "base"
    for sbx in (running, paused):  # connect (a resume for the paused one) hands out the new access token
        again = S.connect(sbx.sandbox_id, timeout=600, request_timeout=CALL_TIMEOUT_S)
        assert again.files.read("mark.txt", request_timeout=CALL_TIMEOUT_S) == sbx.sandbox_id
    again = S.connect(running.sandbox_id, timeout=600, request_timeout=CALL_TIMEOUT_S)
    assert again.commands.run("echo $GREETING", request_timeout=CALL_TIMEOUT_S).stdout == "hello\n"
    assert [s.snapshot_id for s in S.list_snapshots(request_timeout=CALL_TIMEOUT_S).next_items()] == \
        [snap.snapshot_id]
    child = S.create("kept", timeout=600, request_timeout=CALL_TIMEOUT_S)  # the snapshot, by its name
    assert child.files.read("mark.txt", request_timeout=CALL_TIMEOUT_S) == running.sandbox_id
    for sid in (child.sandbox_id, running.sandbox_id, paused.sandbox_id):
        S.kill(sid, request_timeout=CALL_TIMEOUT_S)
    assert S.delete_snapshot(snap.snapshot_id, request_timeout=CALL_TIMEOUT_S) is True
