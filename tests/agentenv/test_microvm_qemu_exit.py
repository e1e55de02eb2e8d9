"""A quitting QEMU is gone only when its last thread is: its leader turns zombie (and its cmdline empty)
before its vCPU threads end, and those still map the guest's RAM file, which then stays in the page cache
after a pause (seen once in CI: 110 MiB left resident)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from microvm_env import resident_pages

from agentenv.backend.microvm import qemu
from agentenv.backend.microvm.snapshots import settle_ram

# maps the file (argv 1), starts a thread that outlives the leader by argv 2 seconds, ends the leader
_LEADER_EXITS_FIRST = """
import ctypes, mmap, sys, threading, time
f = open(sys.argv[1], "r+b"); m = mmap.mmap(f.fileno(), 0); m.read()
threading.Thread(target=time.sleep, args=(float(sys.argv[2]),)).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the calling thread only
"""


def test_wait_gone_waits_for_the_threads_that_outlive_the_leader(tmp_path):
    ram = tmp_path / "ram"
    ram.write_bytes(os.urandom(4 << 20))
    # the vm folder's monitor socket in its argv is how running_pid knows the process as this VM's QEMU
    proc = subprocess.Popen([sys.executable, "-c", _LEADER_EXITS_FIRST, str(ram), "1.0",
                             str(tmp_path / qemu.QMP_SOCKET)])
    try:
        (tmp_path / qemu.PID_FILE).write_text(str(proc.pid))
        deadline = time.monotonic() + 10
        while qemu.running_pid(tmp_path) is not None:  # the leader has exited: it looks gone already
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert resident_pages(ram) > 0
        t0 = time.monotonic()
        assert qemu.wait_gone(tmp_path, proc.pid, 10.0)
        assert time.monotonic() - t0 > 0.3  # it waited for the thread, not only for the leader
        settle_ram(ram)
        assert resident_pages(ram) == 0
    finally:
        proc.kill()
        proc.wait()


def test_wait_gone_gives_up_at_its_deadline(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                             str(tmp_path / qemu.QMP_SOCKET)])
    try:
        (tmp_path / qemu.PID_FILE).write_text(str(proc.pid))
        time.sleep(0.2)
        assert qemu.running_pid(tmp_path) == proc.pid
        assert not qemu.wait_gone(tmp_path, proc.pid, 0.2)
    finally:
        proc.kill()
        proc.wait()
