"""`MicroVMRuntime` (the `microvm` backend): sandboxes as QEMU microVMs behind `SandboxBackend`.

Create copies a golden snapshot's RAM file, pause saves QEMU's device state and drops the RAM from the page
cache, resume maps the RAM file back in a new QEMU, and forks map one snapshot copy-on-write; every
restore is verified by the marker the guest agent reports.

Design: docs/design/sandboxes.md#agentenv-backend-microvm-runtime.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentenv.backend import images
from agentenv.backend.base import (
    LABEL_HOME,
    Checkpoint,
    ContainerNotRunning,
    ContainerRef,
    ContainerSpec,
    ContainerState,
    HostProbe,
    LiveFiles,
    RawExec,
    SandboxBackend,
    Settled,
    ShellStream,
)
from agentenv.backend.microvm import accel, channel, golden, hostfiles, initrd, qemu, rootfs, snapshots
from agentenv.backend.microvm.capabilities import kept_capabilities
from agentenv.backend.microvm.livefiles import AgentFiles
from agentenv.backend.microvm.qemu import Machine
from agentenv.backend.microvm.vmdir import (
    FROZEN,
    PAUSING,
    RESUMED,
    SHARED,
    STATE,
    STREAM,
    Snapshot,
    VmDir,
)
from agentenv.backend.settings import BackendSettings
from agentenv.config import SandboxConfig
from agentenv.errors import CheckpointError, ConfigError, RestoreNotVerified
from agentenv.faults import crash_point

UIDS = {"agent": (1000, 1000), "root": (0, 0)}
MIB = 2**20
GUEST_RAM_STEP = 512 * MIB
OP_TIMEOUT_S = 120.0


class MicroVMRuntime(SandboxBackend):
    """Sandboxes as microVMs (see the module docstring)."""

    def __init__(self, home: Path, settings: BackendSettings, name: str = "microvm",
                 reason: str = "") -> None:
        self.home = home
        self.name = name
        self.reason = reason
        # spare shells are the container backends' (a fork here maps the snapshot; nothing to make ahead)
        self.settings = settings.replace(spare_shells=False)
        self.root = settings.microvm_dir
        self.vms = self.root / "vms"
        self.files = hostfiles.find(settings.microvm_kernel_dir)
        self.vms.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.initrd = initrd.build(self.files, self.root)
        self.accel = accel.choose(settings.microvm_accel, self.files, self.initrd, self.root,
                                  settings.microvm_kvm_probe_s)
        self.cmdline = accel.cmdline(self.accel.name)

    # ---- machines -----------------------------------------------------------------------------------------
    def machine(self, image_tag: str, config: SandboxConfig) -> Machine:
        if config.network != "none":
            raise ConfigError(f"the microvm backend gives sandboxes no network device: network must be none, "
                              f"got {config.network!r}")
        guest = config.memory_bytes + self.settings.microvm_memory_overhead
        memory = math.ceil(guest / GUEST_RAM_STEP) * GUEST_RAM_STEP
        image = rootfs.build(image_tag, self.root, self.files.mkfs_ext4)
        return Machine(qemu=self.files.qemu, accel=self.accel.name, kernel=str(self.files.vmlinux),
                       initrd=str(self.initrd), rootfs=str(image), memory_mib=memory // MIB,
                       smp=max(1, math.ceil(config.cpus)), channels=self.settings.microvm_channels,
                       cmdline=self.cmdline, nice=self.settings.microvm_nice)

    def _vm(self, ref: ContainerRef) -> VmDir:
        return VmDir(self.vms, ref.container)

    def _new_vm(self, spec: ContainerSpec, machine: Machine, **extra: Any) -> VmDir:
        name = spec.name or f"vm-{spec.sandbox_id}"
        if (self.vms / name).exists():
            name = f"{name}-{secrets.token_hex(4)}"
        uid, gid = UIDS[spec.user]
        return VmDir.create(self.vms, name, {
            "home": spec.labels.get(LABEL_HOME, str(self.home)), "sandbox_id": spec.sandbox_id,
            "labels": dict(spec.labels), "machine": machine.to_dict(), "uid": uid, "gid": gid,
            "config": spec.config.to_dict(), "private": False, **extra})

    def _channels(self, vm: VmDir) -> int:
        return int(vm.meta.get("machine", {}).get("channels", self.settings.microvm_channels))

    def _request(self, vm: VmDir, obj: Mapping[str, Any], timeout_s: float = 60.0,
                 **kw: Any) -> dict[str, Any]:
        return channel.request(vm.path, self._channels(vm), obj, timeout_s=timeout_s, **kw)[0]

    # ---- SandboxBackend: host facts ----------------------------------------------------------------------
    def probe(self, image: str, refresh: bool = False) -> HostProbe:
        return HostProbe(True, "a microVM snapshot holds every process whatever its uid: sandboxes run as "
                               "user agent (uid 1000) in the guest")

    def resolve_image(self, image: str) -> str:
        return images.resolve(image)

    def describe(self) -> dict[str, object]:
        return {"backend_reason": self.reason, "accelerator": self.accel.name,
                "accelerator_reason": self.accel.reason,
                "qemu": f"{self.files.qemu} {self.files.qemu_version}",
                "guest_kernel": self.files.kernel_version,
                "initramfs": str(self.initrd), "microvm_dir": str(self.root),
                "microvm_disk_bytes": _disk_bytes(self.vms),
                "isolation": "a virtual machine per sandbox: its own guest kernel, no network device, a "
                             "read-only root disk, the agent's virtio-serial ports as the only channel"}

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def create(self, spec: ContainerSpec) -> ContainerRef:
        machine = self.machine(spec.image, spec.config)
        snap = golden.golden(machine, self.root, self.settings.microvm_boot_timeout_s)
        vm = self._new_vm(spec, machine)
        ref = ContainerRef(vm.name, "")
        try:
            snapshots.copy_sparse(snap.ram, vm.ram)  # type: ignore[arg-type]
            self._start_and_load(vm, machine, snap, vm.ram, share=True)
            uid, gid = vm.meta["uid"], vm.meta["gid"]
            cfg = spec.config
            self._request(vm, {"op": "configure", "uid": uid, "gid": gid, "workspace": cfg.workspace,
                               "tmpfs": dict(cfg.tmpfs), "read_only": cfg.read_only,
                               "cap_keep": sorted(kept_capabilities(cfg.cap_drop, cfg.cap_add)),
                               "no_new_privs": cfg.no_new_privileges, "pids_max": cfg.pids_limit,
                               "memory_max": cfg.memory_bytes, "cpu_max": _cpu_max(cfg.cpus, machine.smp),
                               "sandbox_id": spec.sandbox_id, "seed": secrets.randbits(63),
                               "entropy": secrets.token_hex(64)}, timeout_s=OP_TIMEOUT_S)
            self._resumed(vm, spec.sandbox_id)
        except BaseException:
            self.remove(ref)
            raise
        return ref

    def _start_and_load(self, vm: VmDir, machine: Machine, snap: Snapshot, ram: Path, *,
                        share: bool) -> None:
        """A QEMU for `vm` mapping `ram` (`share`: in place, else copy-on-write) that loads `snap` and
        lets it run."""
        qemu.start(machine, vm.path, ram, share=share, incoming=True)
        try:
            snapshots.load(vm.path, snap.state_file, ram_in_stream=snap.format == STREAM,
                           timeout_s=OP_TIMEOUT_S)
            if snap.path.parent == vm.path:
                (snap.path / RESUMED).touch()  # from here on the guest changes what the snapshot's RAM held
            crash_point("microvm-loaded")
            snapshots.cont(vm.path)
        except BaseException:
            qemu.kill(vm.path)
            raise

    def _resumed(self, vm: VmDir, sandbox_id: str) -> str:
        """Tell the guest it was restored (identity, seed, clock, entropy); the marker it held. The guest
        keeps a fresh one, which its next snapshot will hold (recorded in the VM's meta): a pause needs
        no request for it."""
        marker = secrets.token_hex(16)
        answer = self._request(vm, {"op": "resumed", "sandbox_id": sandbox_id, "seed": secrets.randbits(63),
                                    "time": time.time(), "entropy": secrets.token_hex(64),
                                    "marker": marker}, timeout_s=OP_TIMEOUT_S)
        vm.update_meta(marker=marker)
        return str(answer.get("marker", ""))

    def exec(self, ref: ContainerRef, argv: Sequence[str], *, user: str, timeout_s: float, output_limit: int,
             stdin: bytes | None = None, env: Mapping[str, str] | None = None,
             workdir: str | None = None) -> RawExec:
        vm = self._running_vm(ref)
        uid, gid = UIDS[user]
        return channel.exec_command(vm.path, self._channels(vm), argv, uid=uid, gid=gid, timeout_s=timeout_s,
                                    output_limit=output_limit, stdin=stdin, env=env, workdir=workdir)

    def open_shell(self, ref: ContainerRef, *, user: str) -> ShellStream:
        vm = self._running_vm(ref)
        uid, gid = UIDS[user]
        return channel.AgentShell(vm.path, self._channels(vm), uid=uid, gid=gid)

    def end_shells(self, ref: ContainerRef) -> int:
        vm = self._vm(ref)
        if qemu.running_pid(vm.path) is None:
            return 0
        try:
            return int(self._request(vm, {"op": "end_shells"}).get("count", 0))
        except ContainerNotRunning:
            return 0

    def live_files(self, ref: ContainerRef) -> LiveFiles:
        vm = self._running_vm(ref)
        return AgentFiles(vm.path, self._channels(vm))

    def _running_vm(self, ref: ContainerRef) -> VmDir:
        vm = self._vm(ref)
        if not vm.exists():
            raise ContainerNotRunning("its VM is gone")
        if qemu.running_pid(vm.path) is None:
            raise ContainerNotRunning("its VM does not run")
        if (vm.path / FROZEN).exists():
            raise ContainerNotRunning("its VM is frozen (thaw it first)")
        return vm

    # ---- pause -------------------------------------------------------------------------------------------
    def checkpoint(self, ref: ContainerRef, checkpoint_id: str, *, user: str) -> Checkpoint:
        vm = self._running_vm(ref)
        t0 = time.perf_counter()
        meta = vm.meta
        marker, private = str(meta.get("marker", "")), bool(meta.get("private"))
        folder = vm.snapshot_dir(checkpoint_id)
        folder.mkdir(mode=0o700)
        (vm.path / PAUSING).write_text(str(os.getpid()))
        try:
            try:
                snapshots.save(vm.path, folder / STATE, include_ram=private, timeout_s=OP_TIMEOUT_S)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            crash_point("microvm-saved")
            snap = Snapshot(path=folder, format=STREAM if private else SHARED, marker=marker,
                            machine=vm.machine, ram=None if private else vm.ram, created=time.time())
            snap.save()  # the pause is decided here: the snapshot is whole
            crash_point("microvm-recorded")
            snapshots.quit(vm.path)
            self._settle_paused(vm, snap)
        finally:
            (vm.path / PAUSING).unlink(missing_ok=True)
        return Checkpoint(id=checkpoint_id, path=str(folder), bytes=snap.disk_bytes(), marker=marker,
                          duration_s=time.perf_counter() - t0)

    @staticmethod
    def _settle_paused(vm: VmDir, snap: Snapshot) -> None:
        """After the VM's QEMU quit on a snapshot: no host memory left for it."""
        if snap.format == STREAM:  # its RAM is in the stream: the file it mapped copy-on-write goes (the
            vm.base_ram.unlink(missing_ok=True)  # forks that map it keep it through their own links)
            vm.ram.unlink(missing_ok=True)
            vm.update_meta(private=False)
        elif snap.ram is not None and snap.ram.exists():
            snapshots.settle_ram(snap.ram)

    # ---- resume and fork ---------------------------------------------------------------------------------
    def restore(self, ref: ContainerRef, checkpoint: Checkpoint, *, sandbox_id: str) -> None:
        vm = self._vm(ref)
        snap = Snapshot.load(Path(checkpoint.path))
        if snap is None:
            raise CheckpointError(f"checkpoint {checkpoint.id} at {checkpoint.path} has no record")
        if not vm.machine.same_guest(snap.machine):
            raise CheckpointError(f"checkpoint {checkpoint.id} was made on another machine than this VM's")
        if qemu.running_pid(vm.path) is not None:
            raise CheckpointError(f"the VM of sandbox {sandbox_id} runs already")
        own = snap.path.parent == vm.path
        if snap.format == STREAM:  # RAM from the stream into a new file, mapped in place from then on
            vm.ram.unlink(missing_ok=True)  # never truncate a RAM file: forks may map its inode
            with open(vm.ram, "xb") as f:
                f.truncate(snap.machine.memory_mib * MIB)
            ram, share = vm.ram, True
        elif own and snap.ram is not None and os.stat(snap.ram).st_nlink == 1:
            ram, share = snap.ram, True   # in place: the file is this VM's alone
        else:  # a fork, or a source whose RAM file forks map: copy-on-write
            if not vm.base_ram.exists():
                os.link(snap.ram, vm.base_ram)  # type: ignore[arg-type]
            ram, share = (vm.base_ram if not own else snap.ram), False
        vm.update_meta(private=not share, sandbox_id=sandbox_id)
        self._start_and_load(vm, snap.machine, snap, ram, share=share)  # type: ignore[arg-type]
        try:
            found = self._resumed(vm, sandbox_id)
        except Exception as e:  # noqa: BLE001 - any failure to answer means the restore is not verified
            found = f"(no answer: {e})"
        if found != snap.marker:
            qemu.kill(vm.path)
            raise RestoreNotVerified(f"the VM restored from checkpoint {checkpoint.id} does not hold its "
                                     f"restore marker ({found or 'none'}); the checkpoint is kept at "
                                     f"{checkpoint.path}")

    def fork_files(self, source: ContainerRef, spec: ContainerSpec) -> ContainerRef:
        """A fork's VM folder: its files live in guest memory, so it holds a link to the source's RAM file
        (made here, before any restore, so that the source resumes copy-on-write too)."""
        src = self._vm(source)
        vm = self._new_vm(spec, src.machine, private=True)
        snaps = [s for s in (Snapshot.load(p) for p in src.snapshot_dirs()) if s is not None]
        if snaps and snaps[-1].format == SHARED and snaps[-1].ram is not None:
            os.link(snaps[-1].ram, vm.base_ram)
        return ContainerRef(vm.name, "")

    def discard_checkpoint(self, ref: ContainerRef, checkpoint: Checkpoint) -> None:
        shutil.rmtree(checkpoint.path, ignore_errors=True)

    # ---- freeze / thaw / remove ----------------------------------------------------------------------------
    def freeze(self, ref: ContainerRef) -> None:
        vm = self._running_vm(ref)
        snapshots.stop(vm.path)
        (vm.path / FROZEN).touch()

    def thaw(self, ref: ContainerRef) -> None:
        vm = self._vm(ref)
        if qemu.running_pid(vm.path) is None:
            raise ContainerNotRunning("its VM does not run")
        snapshots.cont(vm.path)
        (vm.path / FROZEN).unlink(missing_ok=True)

    def remove(self, ref: ContainerRef) -> None:
        if not ref.container:
            return
        vm = self._vm(ref)
        qemu.kill(vm.path)
        shutil.rmtree(vm.path, ignore_errors=True)

    # ---- inspection ----------------------------------------------------------------------------------------
    def state(self, ref: ContainerRef) -> ContainerState | None:
        if not ref.container:
            return None
        vm = self._vm(ref)
        if not vm.exists():
            return None
        if qemu.running_pid(vm.path) is not None:
            return ContainerState(running=True, exit_code=None, oom_killed=False, error="")
        died = _console_error(vm)  # the guest's kernel stopped it (a panic), else its QEMU was killed
        return ContainerState(running=False, exit_code=0 if died else 137, oom_killed=False, error=died)

    def usage(self, ref: ContainerRef) -> tuple[int, float, int, int]:
        vm = self._vm(ref)
        pid = qemu.running_pid(vm.path) if vm.exists() else None
        if pid is None:
            return (0, 0.0, 0, 0)
        rss, cpu = qemu.process_usage(pid)
        try:
            u = self._request(vm, {"op": "usage"}, timeout_s=30.0)
        except (ContainerNotRunning, channel.AgentError, OSError):
            return (rss, cpu, 0, 0)
        return (rss, cpu, int(u.get("pids", 0)), int(u.get("oom_kills", 0)))

    def processes(self, ref: ContainerRef) -> list[dict[str, Any]]:
        """The sandbox's processes as its guest lists them (pid, ppid, pgid, state, uid, argv)."""
        return list(self._request(self._running_vm(ref), {"op": "ps"})["processes"])

    # ---- after a death halfway ----------------------------------------------------------------------------
    def settle(self, ref: ContainerRef, sandbox_id: str, recorded: str, checkpoint: Checkpoint | None,
               wait_s: float) -> Settled:
        """A pause whose snapshot is whole ends paused (its stopped QEMU is ended); one that did not finish
        lets the guest go on. A resume that started the guest cannot be undone (the guest runs on the
        snapshot's RAM): it ends running, with its new identity; one whose QEMU died ends lost."""
        vm = self._vm(ref)
        if not vm.exists():
            return Settled(None, note="gone")
        self._wait_pause(vm, wait_s)
        alive = qemu.running_pid(vm.path) is not None
        known = Path(checkpoint.path) if checkpoint is not None else None
        if recorded == "running":
            fresh = [s for s in (Snapshot.load(p) for p in vm.snapshot_dirs())
                     if s is not None and s.path != known and not (s.path / RESUMED).exists()]
            if fresh:
                snap = fresh[-1]
                snapshots.quit(vm.path)
                self._settle_paused(vm, snap)
                return Settled("paused", Checkpoint(id=snap.path.name, path=str(snap.path),
                                                    bytes=snap.disk_bytes(), marker=snap.marker,
                                                    duration_s=0.0), note="paused")
            if alive and snapshots.status(vm.path) in ("paused", "postmigrate"):  # a pause that stopped
                snapshots.cont(vm.path)                                            # short of its record
            return Settled("running") if alive else Settled(None, note="stopped")
        if alive:  # a resume went on after its caller died
            if snapshots.status(vm.path) == "paused":
                snapshots.cont(vm.path)
            self._resumed(vm, sandbox_id)
            return Settled("running", drop_checkpoint=checkpoint is not None, note="resumed")
        if known is not None and (known / RESUMED).exists():
            return Settled(None, note="its VM stopped after a resume had let it run: the snapshot's RAM is "
                                      "no longer the snapshot's")
        return Settled("paused")

    def _wait_pause(self, vm: VmDir, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self._pausing(vm) and time.monotonic() < deadline:
            time.sleep(0.05)

    @staticmethod
    def _pausing(vm: VmDir) -> bool:
        try:
            pid = int((vm.path / PAUSING).read_text())
        except (OSError, ValueError):
            return False
        return os.path.exists(f"/proc/{pid}")

    def dump_in_progress(self, ref: ContainerRef) -> bool:
        return self._pausing(self._vm(ref))

    def drop_leftovers(self, ref: ContainerRef, keep: Checkpoint | None) -> list[str]:
        vm = self._vm(ref)
        dropped = []
        for folder in vm.snapshot_dirs():
            if keep is not None and Path(keep.path) == folder:
                continue
            if Snapshot.load(folder) is None or (folder / RESUMED).exists():
                shutil.rmtree(folder, ignore_errors=True)
                dropped.append(str(folder))
        (vm.path / PAUSING).unlink(missing_ok=True)
        return dropped

    def collect_leftovers(self, dry_run: bool = False, older_than_s: float = 600.0) -> list[str]:
        """`agentenv gc`: golden snapshots of an initramfs or kernel no longer current (a new agent makes
        new ones), initramfs files neither current nor mapped by a VM, and boot folders of golden snapshots
        whose builder died."""
        used = {self.initrd}
        for folder in self.vms.iterdir():
            with contextlib.suppress(KeyError, TypeError):
                used.add(Path(VmDir(self.vms, folder.name).meta["machine"]["initrd"]))
        stale: list[Path] = []
        for folder in (self.root / "golden").glob("*"):
            if folder.name.startswith(".boot-"):
                if time.time() - folder.stat().st_mtime > older_than_s and qemu.running_pid(folder) is None:
                    stale.append(folder)
            elif folder.is_dir():
                snap = Snapshot.load(folder)
                if snap is not None and (Path(snap.machine.initrd) != self.initrd
                                         or snap.machine.kernel != str(self.files.vmlinux)):
                    stale.append(folder)
        stale += [p for p in (self.root / "initrd").glob("*.cpio") if p not in used]
        if not dry_run:
            for path in stale:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    Path(f"{path}.lock").unlink(missing_ok=True)
                else:
                    path.unlink(missing_ok=True)
        return [str(p) for p in stale]

    def sandbox_of_container(self, container: str) -> str | None:
        with contextlib.suppress(ValueError):
            sid = VmDir(self.vms, container).meta.get("sandbox_id")
            return str(sid) if sid else None
        return None

    def list_owned(self, home: str) -> dict[str, list[str]]:
        owned = []
        for folder in self.vms.iterdir() if self.vms.exists() else ():
            meta = VmDir(self.vms, folder.name).meta
            if meta.get("home") == home:
                owned.append(folder.name)
        return {"containers": owned, "volumes": []}


def _cpu_max(cpus: float, smp: int) -> str | None:
    """cgroup v2 `cpu.max` for a fraction of the guest's vCPUs (None: all of them)."""
    if cpus >= smp:
        return None
    return f"{int(cpus * 100000)} 100000"


def _console_error(vm: VmDir) -> str:
    """The guest kernel's last words when it died (a panic), else ''."""
    with contextlib.suppress(OSError):
        lines = (vm.path / qemu.CONSOLE_LOG).read_text(errors="replace").splitlines()
        for line in reversed(lines[-50:]):
            if "Kernel panic" in line or "AGENTENV-BOOT-FAILED" in line:
                return line.strip()
    return ""


def _disk_bytes(root: Path) -> int:
    """Bytes on disk below `root` (RAM files are sparse: their blocks, not their sizes)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total

