"""The security defaults, each checked from inside a real sandbox, and each override honoured."""

from __future__ import annotations

import time

import pytest

from agentenv import AgentEnvError, CheckpointError, SandboxStateError
from agentenv.backend import docker_client
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker


def _status(sb, field: str) -> str:
    for line in sb.exec("cat /proc/self/status").stdout.splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(field)


def _host_config(sb) -> dict:
    return docker_client.api().inspect_container(sb.container_id)["HostConfig"]


def test_default_profile_inside_the_sandbox(sandbox):
    assert _status(sandbox, "CapEff") == "0000000000000000"
    assert _status(sandbox, "CapBnd") == "0000000000000000"
    assert _status(sandbox, "NoNewPrivs") == "1"
    net_dev = sandbox.exec("cat /proc/net/dev").stdout.splitlines()[2:]
    interfaces = [ln.split(":")[0].strip() for ln in net_dev]
    assert interfaces == ["lo"]
    refused = sandbox.exec("touch /etc/x /usr/x")
    assert refused.exit_code != 0 and "Read-only file system" in refused.stderr
    assert sandbox.exec("touch /workspace/ok /tmp/ok && echo yes").stdout == "yes\n"
    uid = sandbox.exec("id -u").stdout.strip()
    assert uid == {"agent": "1000", "root": "0"}[sandbox.user]
    # root here is root without capabilities: it cannot change what it does not own
    assert sandbox.exec("chown 1234 /workspace/ok").exit_code != 0
    hc = _host_config(sandbox)
    assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] is True
    assert hc["PidsLimit"] == 64 and hc["Memory"] == 128 * 2**20 and hc["MemorySwap"] == hc["Memory"]
    assert hc["NanoCpus"] == 10**9


LOOPBACK_ROUND_TRIP = (
    "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "c = socket.create_connection(s.getsockname(), timeout=2); a, _ = s.accept(); c.sendall(b'ok'); "
    "print(a.recv(2).decode())"
)


def test_no_network_means_loopback_only_and_no_docker_network_hook(sandbox):
    """`network: none`: loopback works (before and after a pause), and Docker's network is disabled, so
    no `libnetwork-setkey` prestart hook runs at start or restore (the restore-time cost it removes)."""
    import json

    backend = runtime().backend
    info = docker_client.api().inspect_container(sandbox.container_id)
    assert info["Config"].get("NetworkDisabled") is True
    bundle = backend.host.containerd.bundle(backend.settings.containerd_namespace, info["Id"])
    assert not json.loads((bundle / "config.json").read_text()).get("hooks", {}).get("prestart")
    assert sandbox.exec(["python3", "-c", LOOPBACK_ROUND_TRIP]).stdout == "ok\n"
    sandbox.pause()
    sandbox.resume()
    assert sandbox.exec(["python3", "-c", LOOPBACK_ROUND_TRIP]).stdout == "ok\n"


def test_links_planted_in_the_runtime_dir_do_not_redirect_host_writes(sandbox, tmp_path):
    """The host writes the sandbox's identity into /run/agentenv at every restore (not through `docker
    exec`): a link the sandbox's root put there in place of `seed` is replaced, and its target on the
    host stays as it was. (Sandboxes of uid 1000, where the host allows them, cannot write there.)"""
    canary = tmp_path / "canary"
    canary.write_text("untouched")
    planted = sandbox.exec(["ln", "-sf", str(canary), "/run/agentenv/seed"])
    assert (planted.exit_code == 0) == (sandbox.user == "root")
    sandbox.pause()
    sandbox.resume()
    assert canary.read_text() == "untouched"
    assert sandbox.exec("test -f /run/agentenv/seed && ! test -L /run/agentenv/seed").exit_code == 0
    assert sandbox.exec("cat /run/agentenv/sandbox-id").stdout == sandbox.id


def test_every_default_can_be_turned_off(make_sandbox):
    sb = make_sandbox(read_only=False, network="bridge", cap_drop=[], cap_add=["NET_RAW"],
                      no_new_privileges=False, pids_limit=100, memory="96m", cpus=0.5)
    if sb.user == "root":
        assert sb.exec("touch /etc/written && echo yes").stdout == "yes\n"
    assert sb.exec("touch /var/tmp/written && echo yes").stdout == "yes\n"
    assert _status(sb, "NoNewPrivs") == "0"
    assert "eth0" in sb.exec("cat /proc/net/dev").stdout
    hc = _host_config(sb)
    assert hc["PidsLimit"] == 100 and hc["Memory"] == 96 * 2**20 and hc["NanoCpus"] == 5 * 10**8
    assert hc["ReadonlyRootfs"] is False and hc["CapAdd"] == ["NET_RAW"] and not hc["CapDrop"]


def test_fork_bomb_is_held_by_the_pids_limit_and_the_sandbox_survives(sandbox):
    # `exec sleep` needs no fork, so the command outlives the bomb until the timeout kills its group,
    # unless the bomb filled the pids limit before the command's own shell forked its first `f` (it then
    # exits with 2: seen under load)
    r = sandbox.exec("f() { f | f & }; f; exec sleep 30", timeout=3)
    assert "Cannot fork" in r.stderr and (r.timed_out or r.exit_code == 2), r  # the pids limit said no
    deadline = time.monotonic() + 15
    while True:  # the bomb's processes were killed with the group and reaped by the sandbox's init
        left = sandbox.exec("ps -e --no-headers | wc -l")
        if left.exit_code == 0 and int(left.stdout) < 10:
            break
        assert time.monotonic() < deadline, left
        time.sleep(0.3)
    assert sandbox.exec("echo alive").stdout == "alive\n"
    assert sandbox.status == "running"


def test_memory_hog_is_killed_and_marks_the_sandbox_broken(make_sandbox):
    sb = make_sandbox(memory="64m")
    r = sb.exec("python3 -c 'b = bytearray(300 * 2**20); print(len(b))'")
    assert r.exit_code == 137 and r.oom_killed
    assert sb.status == "broken"
    assert "OOM killer" in sb.reason and "64m" in sb.reason
    with pytest.raises(SandboxStateError, match="broken: the kernel OOM killer"):
        sb.exec("true")


def test_user_agent_runs_as_uid_1000_and_pause_follows_the_host_probe(make_sandbox):
    sb = make_sandbox(user="agent")
    assert sb.user == "agent"
    assert sb.exec("id -un; id -u").stdout == "user\n1000\n"  # uid 1000 is named `user`, as in E2B's images
    assert sb.exec("touch /workspace/mine && stat -c %u /workspace/mine").stdout == "1000\n"
    probe = runtime().backend.probe(sb.image)
    if probe.can_checkpoint_other_uids:
        sb.pause()
        sb.resume()
        assert sb.exec("id -u").stdout == "1000\n"
    else:
        with pytest.raises(CheckpointError, match="cannot checkpoint processes of uid 1000"):
            sb.pause()
        assert sb.status == "running"  # a failed dump leaves the sandbox as it was
        assert sb.exec("echo still here").stdout == "still here\n"


def test_exec_and_file_limits_come_from_the_config(make_sandbox):
    # 3 s: the config's timeout also bounds the file calls below, which a microVM under load (TCG) can
    # take more than a second for
    sb = make_sandbox(exec_timeout_s=3.0, output_limit_bytes=1000, file_limit_bytes=4096,
                      tmpfs={"/tmp": "size=8m,mode=1777", "/scratch": "size=1m"})
    r = sb.exec("head -c 5000 /dev/zero; sleep 10")  # no timeout given: the config's 3 s applies
    assert r.timed_out and r.truncated and len(r.stdout) == 1000
    with pytest.raises(AgentEnvError, match="file_limit_bytes=4096"):
        sb.write_file("big", b"x" * 5000)
    sb.exec("head -c 5000 /dev/zero > /workspace/big")
    with pytest.raises(AgentEnvError, match="bigger than file_limit_bytes=4096"):
        sb.read_file("big")
    sizes = sb.exec("df -k /tmp /scratch | tail -2").stdout.split()
    assert (sizes[1], sizes[7]) == ("8192", "1024")
