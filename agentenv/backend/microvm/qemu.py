"""A sandbox VM's QEMU: the machine (`Machine`: what a snapshot must be restored into, kept in every VM's
and snapshot's record), its command line, and its process.

The VM gets only what a sandbox needs (a read-only root disk, a serial console, the agent's ports; no
network device), and QEMU runs detached under its seccomp sandbox, so it outlives its starter safely.

Design: docs/design/sandboxes.md#agentenv-backend-microvm-qemu.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import AgentEnvError
from agentenv.owner import start_ticks

QMP_SOCKET = "qmp.sock"
PID_FILE = "qemu.pid"
CONSOLE_LOG = "console.log"
QEMU_LOG = "qemu.log"
# TCG's buffer of translated guest code (QEMU's default is 1 GiB, which a guest fills with tens of MiB of
# private memory per VM); when full it is flushed and code is translated again.
TCG_CODE_MIB = 32


@dataclass(frozen=True)
class Machine:
    """Everything the QEMU command line of a VM depends on but its folder and how RAM is mapped."""

    qemu: str
    accel: str              # "kvm" | "tcg"
    kernel: str             # vmlinux (PVH)
    initrd: str
    rootfs: str             # the root file system image (read-only disk)
    memory_mib: int
    smp: int
    channels: int
    cmdline: str
    nice: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Machine:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def same_guest(self, other: Machine) -> bool:
        """Can a snapshot of `other` be loaded into this machine (all but the niceness agree)?"""
        return dataclasses.replace(self, nice=0) == dataclasses.replace(other, nice=0)


def channel_socket(vm_dir: Path, i: int) -> Path:
    return vm_dir / f"ch{i}.sock"


def command(m: Machine, vm_dir: Path, ram: Path, *, share: bool, incoming: bool) -> list[str]:
    """QEMU's argv for machine `m` in folder `vm_dir` with guest RAM in `ram` (see the module docstring)."""
    if m.accel == "kvm":
        machine = "microvm,acpi=on,pit=off,pic=off,rtc=on"
        cpu = ["-accel", "kvm", "-cpu", "host,-arch-capabilities"]
    else:
        machine = "microvm,acpi=on,pit=on,pic=on,rtc=on"
        cpu = ["-accel", f"tcg,tb-size={TCG_CODE_MIB}", "-cpu", "max"]
    argv = [m.qemu, "-M", f"{machine},x-option-roms=off,dump-guest-core=off,memory-backend=mem", *cpu,
            "-m", f"{m.memory_mib}M", "-smp", str(m.smp), "-nodefaults", "-no-user-config",
            "-display", "none", "-no-reboot", "-kernel", m.kernel, "-initrd", m.initrd, "-append", m.cmdline,
            "-object", f"memory-backend-file,id=mem,size={m.memory_mib}M,mem-path={ram},"
                       f"share={'on' if share else 'off'}",
            "-chardev", f"file,id=log,path={vm_dir / CONSOLE_LOG},append=on", "-serial", "chardev:log",
            "-drive", f"id=root,file={m.rootfs},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=root",
            "-device", f"virtio-serial-device,max_ports={m.channels + 1}"]  # port 0: consoles only
    for i in range(m.channels):
        argv += ["-chardev", f"socket,id=ch{i},path={channel_socket(vm_dir, i)},server=on,wait=off",
                 "-device", f"virtserialport,chardev=ch{i},name=agentenv.{i}"]
    argv += ["-qmp", f"unix:{vm_dir / QMP_SOCKET},server=on,wait=off",
             "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
             "-pidfile", str(vm_dir / PID_FILE)]
    if incoming:
        argv += ["-incoming", "defer"]
    if m.nice:
        argv = ["nice", "-n", str(m.nice), *argv]
    return argv


def start(m: Machine, vm_dir: Path, ram: Path, *, share: bool, incoming: bool,
          timeout_s: float = 60.0) -> int:
    """Start QEMU for the VM in `vm_dir` (detached, see the module docstring); its pid once its monitor
    socket exists. AgentEnvError with QEMU's own message when it exits first."""
    sockets = [channel_socket(vm_dir, i) for i in range(m.channels)]
    for stale in [vm_dir / QMP_SOCKET, vm_dir / PID_FILE, *sockets]:
        stale.unlink(missing_ok=True)
    log = vm_dir / QEMU_LOG
    argv = command(m, vm_dir, ram, share=share, incoming=incoming)
    r = subprocess.run(["sh", "-c", 'log=$1; shift; "$@" </dev/null >/dev/null 2>>"$log" & echo $!', "sh",
                        str(log), *argv], capture_output=True, text=True, timeout=timeout_s)
    pid = int(r.stdout.strip() or 0)
    deadline = time.monotonic() + timeout_s
    while not (vm_dir / QMP_SOCKET).exists():
        if not _alive(pid):
            err = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
            raise AgentEnvError(f"QEMU could not start the VM in {vm_dir}: {' | '.join(err) or 'it exited'}")
        if time.monotonic() > deadline:
            kill(vm_dir)
            raise AgentEnvError(f"QEMU did not start within {timeout_s:g} s")
        time.sleep(0.001)
    return pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def running_pid(vm_dir: Path) -> int | None:
    """The pid of the VM's QEMU while it runs (its pid file names a live QEMU of this folder), else None."""
    try:
        pid = int((vm_dir / PID_FILE).read_text().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, ValueError):
        return None
    if f"{vm_dir / QMP_SOCKET}".encode() not in cmdline:
        return None  # the pid was reused
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return None
    return pid


def kill(vm_dir: Path, wait_s: float = 10.0) -> None:
    """SIGKILL the VM's QEMU and wait until it is gone (no-op when it does not run)."""
    pid = running_pid(vm_dir)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_gone(vm_dir, pid, wait_s)


def wait_gone(vm_dir: Path, pid: int, wait_s: float) -> bool:
    """Wait until the QEMU `pid` of `vm_dir` is gone with every thread: its leader turns zombie (and its
    cmdline empty) before its vCPU threads end, and those still map the guest's RAM file."""
    started = start_ticks(pid)
    deadline = time.monotonic() + wait_s
    while running_pid(vm_dir) == pid or (started is not None and _threads_alive(pid, started)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _threads_alive(pid: int, started: str) -> bool:
    """Whether a thread of the process `pid` that started at `started` (not a later one of the same pid)
    has not exited yet."""
    if start_ticks(pid) != started:
        return False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                    return True
    return False


def process_usage(pid: int) -> tuple[int, float]:
    """(resident bytes, CPU seconds) of a QEMU process."""
    rss, cpu = 0, 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, cpu
