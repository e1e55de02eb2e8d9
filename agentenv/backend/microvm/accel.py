"""Which accelerator runs the guests: KVM where a Linux guest really boots on it, TCG (QEMU's own CPU
emulation) otherwise. `/dev/kvm` alone proves little: a nested hypervisor without hardware virtualisation
(e.g. PVM inside a Firecracker VM) opens it and then emulates every guest kernel instruction, and Debian's
kernel never reaches its init there. So the probe boots the guest kernel with the initramfs under KVM and
waits (at most `microvm_kvm_probe_s`) for its init to report; the answer is cached per boot, QEMU, kernel
in `<microvm_dir>/accel.json`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.microvm import qemu
from agentenv.backend.microvm.hostfiles import HostFiles
from agentenv.backend.microvm.vmdir import read_json, write_json
from agentenv.errors import BackendUnavailable
from agentenv.locks import file_lock

PROBE_OK = "AGENTENV-PROBE-OK"


@dataclass(frozen=True)
class Accel:
    name: str       # "kvm" | "tcg"
    reason: str     # why (for `agentenv info`)


def host_tsc_khz() -> int:
    """The host's TSC frequency: a TCG guest reads the host's TSC, and cannot calibrate it on a busy host."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    return 0


def cmdline(accel: str) -> str:
    """The guest kernel's command line."""
    args = ["console=ttyS0", "quiet", "panic=-1", "random.trust_cpu=on"]
    if accel == "tcg":
        # a calibration against the emulated PIT fails on a loaded host and the boot then hangs; the TCG
        # guest's TSC is the host's, whose frequency is known. Guest-kernel mitigations buy nothing in an
        # emulated CPU and cost every system call.
        khz = host_tsc_khz()
        args += ([f"tsc_early_khz={khz}"] if khz else []) + ["tsc=reliable", "mitigations=off"]
    return " ".join(args)


def _kvm_boots(files: HostFiles, initrd: Path, timeout_s: float) -> tuple[bool, str]:
    """Boot the guest kernel under KVM up to its init; (did it, what happened)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
    except OSError as e:
        return False, f"/dev/kvm cannot be opened ({e.strerror})"
    with tempfile.TemporaryDirectory(prefix="agentenv-kvm-probe-") as tmp:
        folder = Path(tmp)
        ram = folder / "ram"
        ram.touch()
        machine = qemu.Machine(qemu=files.qemu, accel="kvm", kernel=str(files.vmlinux), initrd=str(initrd),
                               rootfs=str(initrd), memory_mib=256, smp=1, channels=1,
                               cmdline=cmdline("kvm") + " agentenv.probe")
        argv = qemu.command(machine, folder, ram, share=False, incoming=False)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        log = folder / qemu.CONSOLE_LOG
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    if PROBE_OK in log.read_text(errors="replace"):
                        return True, "a Linux guest boots under KVM"
                if proc.poll() is not None:
                    err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace").strip()
                    return False, (f"QEMU with KVM exited before the guest's init ran "
                                   f"({err[-200:] or 'no error'})")
                time.sleep(0.05)
            return False, (f"/dev/kvm opens, but the guest kernel did not reach its init within "
                           f"{timeout_s:g} s (no hardware virtualisation: a nested hypervisor emulates the "
                           "guest kernel)")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()


def choose(configured: str, files: HostFiles, initrd: Path, microvm_dir: Path, probe_s: float) -> Accel:
    """The accelerator for `configured` (`auto`, `kvm` or `tcg`); BackendUnavailable when `kvm` was asked
    for and a guest does not boot on it."""
    if configured == "tcg":
        return Accel("tcg", "configured (microvm_accel: tcg)")
    key = {"boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(), "qemu": files.qemu_version,
           "kernel": files.kernel_version}
    cache = microvm_dir / "accel.json"
    microvm_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(microvm_dir / "accel.lock"):
        cached = read_json(cache)
        if cached and cached.get("key") == key:
            ok, why = cached["kvm"], cached["why"]
        else:
            ok, why = _kvm_boots(files, initrd, probe_s)
            write_json(cache, {"key": key, "kvm": ok, "why": why})
    if ok:
        return Accel("kvm", f"KVM: {why} (probed)")
    if configured == "kvm":
        raise BackendUnavailable(f"microvm_accel: kvm is configured, but {why}")
    return Accel("tcg", f"TCG (QEMU's CPU emulation): {why}")
