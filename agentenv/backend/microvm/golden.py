"""Golden snapshots: one booted, paused guest per machine (image, guest RAM, vCPUs, kernel, initramfs,
accelerator), from which every new sandbox of that machine starts instead of booting (a boot under TCG
takes seconds). Made on first use by booting the guest until its agent reports, then snapshotting it in
place; kept under `<microvm_dir>/golden/<machine hash>/` (`ram`, `state`, `record.json`) and never
written again: a new sandbox copies its RAM file, so the golden one is only read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shutil
import time
from pathlib import Path

from agentenv.backend.microvm import channel, qemu, snapshots
from agentenv.backend.microvm.qemu import Machine
from agentenv.backend.microvm.vmdir import RAM, SHARED, STATE, Snapshot
from agentenv.errors import BackendUnavailable
from agentenv.locks import file_lock

READY = "AGENTENV-READY"
FAILED = "AGENTENV-BOOT-FAILED"


def key(m: Machine) -> str:
    data = {k: v for k, v in m.to_dict().items() if k != "nice"}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]


def _wait_ready(folder: Path, timeout_s: float) -> None:
    """Until the guest's agent reported on the console; BackendUnavailable when the boot failed."""
    log = folder / qemu.CONSOLE_LOG
    deadline = time.monotonic() + timeout_s
    while True:
        text = ""
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace")
        if FAILED in text:
            line = next(ln for ln in text.splitlines() if FAILED in ln)
            raise BackendUnavailable(f"the sandbox VM's guest failed to boot: {line.strip()} (console log: "
                                     f"{log})")
        if READY in text:
            return
        if qemu.running_pid(folder) is None:
            tail = " | ".join(text.strip().splitlines()[-3:])
            raise BackendUnavailable(f"the sandbox VM's QEMU exited while the guest booted "
                                     f"({tail or 'no output'}; console log: {log})")
        if time.monotonic() > deadline:
            qemu.kill(folder)
            raise BackendUnavailable(f"the sandbox VM's guest did not boot within {timeout_s:g} s "
                                     f"(console log: {log})")
        time.sleep(0.05)


def golden(m: Machine, microvm_dir: Path, boot_timeout_s: float) -> Snapshot:
    """The golden snapshot of machine `m`, booted now when there is none."""
    root = microvm_dir / "golden"
    folder = root / key(m)
    snap = Snapshot.load(folder)
    if snap is not None:
        return snap
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f"{folder.name}.lock"):
        snap = Snapshot.load(folder)
        if snap is not None:
            return snap
        boot = root / f".boot-{folder.name}"
        shutil.rmtree(boot, ignore_errors=True)
        boot.mkdir(mode=0o700)
        try:
            ram = boot / RAM
            with open(ram, "wb") as f:
                f.truncate(m.memory_mib * 2**20)
            qemu.start(m, boot, ram, share=True, incoming=False)
            _wait_ready(boot, boot_timeout_s)
            marker = secrets.token_hex(16)
            channel.request(boot, m.channels, {"op": "mark", "marker": marker}, timeout_s=boot_timeout_s)
            snapshots.save(boot, boot / STATE, include_ram=False, timeout_s=boot_timeout_s)
            snapshots.quit(boot)
            snapshots.settle_ram(ram)
            boot.rename(folder)
            snap = Snapshot(path=folder, format=SHARED, marker=marker, machine=m, ram=folder / RAM,
                            created=time.time())
            snap.save()
            return snap
        finally:
            qemu.kill(boot)
            shutil.rmtree(boot, ignore_errors=True)
