"""`agentenv serve` on the microvm backend, driven by the unmodified `e2b` SDK: commands (the E2B test's own
cases), files, a pause that leaves no process and a connect that brings the process's memory back, forks,
kill; and its faults: a VM killed behind the server's back is reported gone, and a server killed with kill
-9 and started again finds its running and paused sandboxes, which are usable with their memory. One
server for the module (the `server` and `served` fixtures), restarted by the last test."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import yaml
from netns_hosts import API_KEY, ROOT
from test_server_e2b import COUNTER, _n, _poll, test_commands_through_the_sdk  # noqa: F401 - collected here
from test_server_faults import CALL_TIMEOUT_S, Served, _listed, _sdk

pytestmark = pytest.mark.docker

sys.path.insert(0, str(ROOT / "tests" / "agentenv"))
from agentenv_testutil import SMALL  # noqa: E402
from microvm_env import TOKEN_PROCESS, microvm_home  # noqa: E402

TOKEN = TOKEN_PROCESS + "; cat /tmp/token"
# test_server_e2b's COUNTER that first writes a random token into /tmp (tmpfs: the guest's memory): one
# python3 start in the guest for both (a cold one costs seconds under TCG)
COUNTER_WITH_TOKEN = COUNTER.replace("import os, time\n", "import os, time\n"
                                     "open(\"/tmp/token\", \"w\").write(os.urandom(8).hex())\n", 1)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("microvm-serve").resolve()
    from agentenv import SandboxConfig

    sandbox_conf = home / "sandbox.yaml"
    sandbox_conf.write_text(yaml.safe_dump(SandboxConfig.load(**SMALL).to_dict()))
    server_conf = home / "server.yaml"
    conf = yaml.safe_load((ROOT / "conf" / "agentenv" / "server.yaml").read_text())
    server_conf.write_text(yaml.safe_dump({**conf, "liveness_check_interval_s": 1.0}))
    with microvm_home(home / "client"):
        env = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_API_KEY": API_KEY,
               "AGENTENV_CONFIG": str(sandbox_conf), "AGENTENV_SERVER_CONFIG": str(server_conf)}
        env.pop("AGENTENV_SERVER", None)
        subprocess.run([sys.executable, "-m", "agentenv.cli", "images", "build", "base", "--quiet"], env=env,
                       check=True, cwd=ROOT, capture_output=True, timeout=600)
        srv = Served(home, env)
        old = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=API_KEY)
        os.environ.pop("E2B_DOMAIN", None)
        try:
            srv.start()
            yield srv
        finally:
            srv.stop()
            from microvm_env import remove_vms

            remove_vms(home)
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="module")
def server(served) -> Served:
    """For the E2B tests' `sdk_sandbox` fixture: this module's server."""
    return served


def _vm_pid(served: Served, sandbox_id: str) -> int | None:
    from agentenv.backend.microvm import qemu
    from agentenv.backend.microvm.vmdir import VmDir
    from agentenv.backend.settings import BackendSettings

    vms = BackendSettings.load().microvm_dir / "vms"
    for folder in vms.iterdir():
        meta = VmDir(vms, folder.name).meta
        if meta.get("sandbox_id") == sandbox_id and meta.get("home") == str(served.home):
            return qemu.running_pid(folder) or 0
    return None


def test_files_and_the_pty_through_the_sdk(sdk_sandbox):
    sb = sdk_sandbox(timeout=300)
    info = sb.files.write("dir/a.txt", "hello file")
    assert info.path == "/home/user/dir/a.txt"
    blob = bytes(range(256)) * 64
    sb.files.write("/workspace/dir/b.bin", blob)
    assert sb.files.read("dir/a.txt") == "hello file"
    assert bytes(sb.files.read("dir/b.bin", format="bytes")) == blob
    assert {e.name for e in sb.files.list("dir")} == {"a.txt", "b.bin"}
    assert sb.files.rename("dir/a.txt", "dir/c.txt").path == "/home/user/dir/c.txt"
    owned = sb.files.get_info("dir/c.txt")
    assert (owned.owner, owned.group, owned.size) == ("user", "user", 10)
    sb.files.remove("dir/c.txt")
    assert not sb.files.exists("dir/c.txt")
    assert sb.commands.run("id -u; pwd", cwd="dir").stdout == "1000\n/home/user/dir\n"
    with pytest.raises(Exception, match="no work-dir volume"):
        sb.files.watch_dir("dir")  # watching needs the work dir on the host: a VM's is in its memory
    from e2b.sandbox.commands.command_handle import CommandExitException, PtySize

    term = sb.pty.create(PtySize(rows=24, cols=80))
    assert sb.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):
        term.wait()


def test_pause_connect_fork_kill(served, sdk_sandbox):
    sb = sdk_sandbox(timeout=300)
    sb.files.write("note.txt", "kept")
    counter = sb.commands.run(COUNTER_WITH_TOKEN, background=True)
    before = _poll(lambda: (n := _n(sb)) >= 2 and n, 30, "the counter to count")
    token = sb.commands.run("cat /tmp/token").stdout.strip()  # written before the first count
    assert len(token) == 16, token
    assert sb.pause() is True
    assert _vm_pid(served, sb.sandbox_id) == 0  # the VM's QEMU is gone: no process
    sb = _sdk().connect(sb.sandbox_id, timeout=300)
    assert sb.commands.run("cat /tmp/token").stdout.strip() == token  # the process's memory is back
    assert _n(sb) >= before and counter.pid in [p.pid for p in sb.commands.list()]
    _poll(lambda: _n(sb) > before, 30, "the counter to go on after connect")
    forks = sb.fork(count=2)
    try:
        for f in forks:
            assert f.files.read("note.txt") == "kept"
            assert f.commands.run("cat /tmp/token").stdout.strip() == token
            f.commands.run("echo mine > note.txt")
        assert sb.files.read("note.txt") == "kept"
    finally:
        for f in forks:
            f.kill()
    assert sb.kill() is True
    assert _vm_pid(served, sb.sandbox_id) is None  # its VM's folder is gone too


def test_a_killed_vm_is_gone_and_a_killed_server_finds_its_sandboxes_again(served):
    from e2b.exceptions import NotFoundException

    S = _sdk()
    doomed = S.create("base", timeout=600, request_timeout=CALL_TIMEOUT_S)
    os.kill(_vm_pid(served, doomed.sandbox_id), 9)
    with pytest.raises(NotFoundException, match=r"gone"):
        doomed.commands.run("true", request_timeout=CALL_TIMEOUT_S)
    r = httpx.get(f"{served.url}/sandboxes/{doomed.sandbox_id}", headers={"X-API-Key": API_KEY},
                  timeout=CALL_TIMEOUT_S)
    assert r.status_code == 404 and "gone" in r.json()["message"], r.text

    kept = []
    for state in ("running", "paused"):
        sbx = S.create("base", timeout=600, request_timeout=CALL_TIMEOUT_S)
        token = sbx.commands.run(TOKEN, request_timeout=CALL_TIMEOUT_S).stdout.strip()
        if state == "paused":
            sbx.pause(request_timeout=CALL_TIMEOUT_S)
        kept.append((sbx.sandbox_id, state, token))
    served.kill9()
    served.start()
    listed = _listed()
    for sid, state, token in kept:
        assert listed.get(sid) == state, (sid, listed)
        again = S.connect(sid, timeout=600, request_timeout=CALL_TIMEOUT_S)
        assert again.commands.run("cat /tmp/token", request_timeout=CALL_TIMEOUT_S).stdout.strip() == token
        again.kill(request_timeout=CALL_TIMEOUT_S)
    assert "Traceback" not in served.log.read_text()
