"""Moving a VM's state through QEMU's migration, to and from files.

`save` and `load` of QEMU's device state (the RAM stays in the VM's RAM file), `settle_ram` (sync the RAM
file and drop it from the page cache: no host memory while paused) and `copy_sparse`.

Design: docs/design/sandboxes.md#agentenv-backend-microvm-snapshots.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from agentenv.backend.microvm import qemu
from agentenv.backend.microvm.qmp import Qmp, QmpError
from agentenv.errors import CheckpointError

POLL_S = 0.001


def _set_ignore_shared(q: Qmp, on: bool) -> None:
    q.call("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": on}])


def save(vm_dir: Path, out: Path, *, include_ram: bool, timeout_s: float) -> None:
    """Stop the VM and write its state into `out` (see the module docstring); QEMU stays, stopped, until
    `quit`. On a failure the guest goes on and CheckpointError says why."""
    if qemu.running_pid(vm_dir) is None:
        raise CheckpointError(f"the VM in {vm_dir} does not run")
    with Qmp(vm_dir / qemu.QMP_SOCKET, timeout_s=timeout_s) as q:
        q.call("stop")
        try:
            _set_ignore_shared(q, not include_ram)
            if include_ram:  # one pass of a stopped guest: no reason to throttle it
                q.call("migrate-set-parameters", **{"max-bandwidth": 2**40})
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                q.call("getfd", fds=[fd], fdname="snapshot")
            finally:
                os.close(fd)
            q.call("migrate", uri="fd:snapshot")
            deadline = time.monotonic() + timeout_s
            while True:
                info = q.call("query-migrate")
                status = info.get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled"):
                    raise CheckpointError(f"QEMU could not save the VM's state: "
                                          f"{info.get('error-desc', status)}")
                if time.monotonic() > deadline:
                    q.call("migrate_cancel")
                    raise CheckpointError(f"QEMU did not save the VM's state within {timeout_s:g} s")
                time.sleep(POLL_S)
            with open(out, "rb+") as f:
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(QmpError):
                q.call("cont")
            raise


def quit(vm_dir: Path, timeout_s: float = 30.0) -> None:
    """End the VM's QEMU (after `save`) and wait until it is gone."""
    pid = qemu.running_pid(vm_dir)
    if pid is None:
        return
    with contextlib.suppress(QmpError), Qmp(vm_dir / qemu.QMP_SOCKET, timeout_s=timeout_s) as q:
        q.call("quit")
    if not qemu.wait_gone(vm_dir, pid, timeout_s):
        qemu.kill(vm_dir)


def status(vm_dir: Path, timeout_s: float = 10.0) -> str | None:
    """QEMU's run state (`running`, `paused`, `inmigrate`, ...), None when its monitor does not answer."""
    try:
        with Qmp(vm_dir / qemu.QMP_SOCKET, timeout_s=timeout_s) as q:
            return str(q.call("query-status")["status"])
    except QmpError:
        return None


def load(vm_dir: Path, state: Path, *, ram_in_stream: bool, timeout_s: float) -> None:
    """Feed `state` to the VM's waiting QEMU (`-incoming defer`) and let the guest run. CheckpointError when
    QEMU refused it (it then exits)."""
    with Qmp(vm_dir / qemu.QMP_SOCKET, timeout_s=timeout_s) as q:
        try:
            _set_ignore_shared(q, not ram_in_stream)
            fd = os.open(state, os.O_RDONLY)
            try:
                q.call("getfd", fds=[fd], fdname="snapshot")
            finally:
                os.close(fd)
            q.call("migrate-incoming", uri="fd:snapshot")
            deadline = time.monotonic() + timeout_s
            while (status := q.call("query-status")["status"]) != "paused":
                if status not in ("inmigrate", "prelaunch"):
                    raise CheckpointError(f"QEMU ended the load of {state.parent.name} in state {status!r}")
                if time.monotonic() > deadline:
                    raise CheckpointError(f"QEMU did not load {state.parent.name} within {timeout_s:g} s")
                time.sleep(POLL_S)
        except QmpError as e:
            raise CheckpointError(f"QEMU could not load the snapshot {state.parent.name} (its QEMU exited: "
                                  f"the snapshot does not fit this machine or is damaged): {e}") from None


def cont(vm_dir: Path, timeout_s: float = 30.0) -> None:
    with Qmp(vm_dir / qemu.QMP_SOCKET, timeout_s=timeout_s) as q:
        q.call("cont")


def stop(vm_dir: Path, timeout_s: float = 30.0) -> None:
    with Qmp(vm_dir / qemu.QMP_SOCKET, timeout_s=timeout_s) as q:
        q.call("stop")


def settle_ram(ram: Path) -> None:
    """Write a paused VM's RAM file to disk and drop it from the page cache (pages another process still
    maps, e.g. a running fork's, stay)."""
    fd = os.open(ram, os.O_RDWR)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def copy_sparse(src: Path, dst: Path) -> None:
    """`dst` := `src`, holes kept as holes (only the data extents are copied, in the kernel)."""
    size = src.stat().st_size
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.truncate(size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data past pos
                break
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            offset = start
            while offset < end:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), end - offset, offset, offset)
                if n <= 0:
                    break
                offset += n
            pos = end
