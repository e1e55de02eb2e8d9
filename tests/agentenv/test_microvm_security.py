"""The security probes of the container tests, run inside microVMs, and what a VM changes: root inside the
guest is not root on the host (another kernel, none of the host's files or processes), and the guest
reaches nothing but its agent's ports: no network device, one read-only disk, no shared folder. The
limits (pids, memory, time, output, file sizes, tmpfs sizes) are the guest's cgroup and the agent's."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from agentenv_testutil import SMALL
from microvm_env import microvm_home
from test_agentenv_security import (  # noqa: F401 - collected here with this module's fixtures
    LOOPBACK_ROUND_TRIP,
    test_exec_and_file_limits_come_from_the_config,
    test_fork_bomb_is_held_by_the_pids_limit_and_the_sandbox_survives,
    test_memory_hog_is_killed_and_marks_the_sandbox_broken,
    test_user_agent_runs_as_uid_1000_and_pause_follows_the_host_probe,
)

from agentenv import Sandbox, SandboxConfig
from agentenv.backend.microvm import qemu
from agentenv.backend.settings import BackendSettings

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def microvm(base_image, tmp_path_factory):
    with microvm_home(tmp_path_factory.mktemp("microvm-security")) as home:
        yield home


@pytest.fixture
def make_sandbox(microvm):
    made = []

    def make(**overrides):
        sb = Sandbox.create(config=SandboxConfig.load(**{**SMALL, **overrides}))
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


@pytest.fixture
def sandbox(make_sandbox):
    return make_sandbox()


@pytest.fixture(scope="module")
def probed(microvm):
    """One default sandbox for the tests that only look at it (its profile, its devices): a VM less."""
    sb = Sandbox.create(config=SandboxConfig.load(**SMALL))
    yield sb
    sb.close()


def _statuses(sb) -> dict[str, str]:
    """The fields of /proc/self/status of a command in the sandbox."""
    lines = sb.exec("cat /proc/self/status").stdout.splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _status(sb, field: str) -> str:
    status = _statuses(sb)
    assert field in status, field
    return status[field]


def _qemu_argv(sb) -> list[str]:
    vm = BackendSettings.load().microvm_dir / "vms" / (sb.container_id or "")
    pid = qemu.running_pid(vm)
    assert pid is not None
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_default_profile_inside_the_guest(probed):
    status = _statuses(probed)
    assert status["CapEff"] == "0000000000000000"
    assert status["CapBnd"] == "0000000000000000"
    assert status["NoNewPrivs"] == "1"
    net_dev = probed.exec("cat /proc/net/dev").stdout.splitlines()[2:]
    assert [ln.split(":")[0].strip() for ln in net_dev] == ["lo"]
    assert probed.exec(["python3", "-c", LOOPBACK_ROUND_TRIP]).stdout == "ok\n"
    refused = probed.exec("touch /etc/x /usr/x")
    assert refused.exit_code != 0 and "Read-only file system" in refused.stderr
    assert probed.exec("touch /workspace/ok /tmp/ok && echo yes").stdout == "yes\n"
    assert probed.exec("id -u").stdout.strip() == "1000" and probed.user == "agent"
    assert probed.exec("chown 1234 /workspace/ok").exit_code != 0
    # the limits live in the guest's cgroup, which the sandbox cannot write
    assert probed.exec("cat /sys/fs/cgroup/sandbox/pids.max").stdout.strip().isdigit()
    assert probed.exec("echo max > /sys/fs/cgroup/sandbox/pids.max").exit_code != 0


def test_root_in_the_guest_is_not_root_on_the_host(make_sandbox, tmp_path):
    sb = make_sandbox(user="root")
    assert sb.exec("id -u").stdout == "0\n" and _status(sb, "CapEff") == "0000000000000000"
    canary = tmp_path / f"host-canary-{secrets.token_hex(4)}"
    canary.write_text("host only")
    assert sb.exec(f"cat {canary} || ls {tmp_path}").exit_code != 0  # none of the host's files
    host_kernel = Path("/proc/sys/kernel/osrelease").read_text().strip()
    assert sb.exec("uname -r").stdout.strip() != host_kernel  # a kernel of its own
    processes = sb.exec("ps -eo comm --no-headers").stdout.split()
    assert "qemu-system-x86" not in processes and "pytest" not in processes and len(processes) < 10
    # a write to the image's disk is refused by the virtual device itself
    wrote = sb.exec("dd if=/dev/zero of=/dev/vda bs=4096 count=1 conv=notrunc")
    assert wrote.exit_code != 0, wrote
    # root without capabilities cannot mount, load modules or reach the agent's ports
    assert sb.exec("mount -t tmpfs x /mnt").exit_code != 0
    ports = sb.exec("ls /dev | grep vport").stdout.split()
    assert ports and all(sb.exec(f"head -c1 /dev/{p}", timeout=5).exit_code != 0 for p in ports)


def test_the_guest_reaches_nothing_but_its_agent_ports(probed):
    argv = _qemu_argv(probed)
    devices = [argv[i + 1].split(",")[0] for i, a in enumerate(argv) if a == "-device"]
    assert sorted(set(devices)) == ["virtio-blk-device", "virtio-serial-device", "virtserialport"], devices
    assert "-nodefaults" in argv and not {"-netdev", "-nic", "-net", "-fsdev", "-virtfs"} & set(argv)
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert len(drives) == 1 and "readonly=on" in drives[0]
    assert argv[argv.index("-sandbox") + 1].startswith("on,")  # QEMU under seccomp
    assert probed.exec("ls /sys/class/net").stdout.split() == ["lo"]
    # inside: virtio devices are the console's ports and the disk (ids 3 and 2), nothing else
    kinds = probed.exec("cat /sys/bus/virtio/devices/*/device").stdout.split()
    assert sorted(kinds) == ["0x0002", "0x0003"], kinds
