"""Bring up the loopback interface of a restored sandbox's network namespace, from the host.

Sandboxes without a network are created with Docker's network disabled (no `libnetwork-setkey` prestart
hook, see `containers.py`). runc then brings `lo` up itself at a fresh start, but a CRIU restore gets a
new network namespace whose `lo` is down, which the hook used to fix. The restore calls `loopback_up`
right after Docker returns, before anything else reaches the sandbox; a process that opens a loopback
connection in the milliseconds between is refused (ENETUNREACH) and sees `lo` up on its next try.
(Established TCP connections cannot be checkpointed without CRIU's `tcp-established`, so none is lost.)

It runs in a short-lived thread of this process: `setns` moves only the calling thread, which then
exits, so no other thread ever leaves the host's namespace.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"  # struct ifreq: name, then ifr_flags (short) in the union


class NetnsError(OSError):
    """The loopback of a sandbox's network namespace could not be brought up."""


def _set_up(netns_path: str, result: list[BaseException]) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise NetnsError(err, f"setns({netns_path}): {os.strerror(err)}")
        finally:
            os.close(fd)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
            if not flags & _IFF_UP:
                fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    except BaseException as e:  # reported by the caller's thread
        result.append(e)


def loopback_up(pid: int) -> None:
    """`ip link set lo up` inside the network namespace of process `pid` (a host pid)."""
    result: list[BaseException] = []
    worker = threading.Thread(target=_set_up, args=(f"/proc/{pid}/ns/net", result), name="netns-lo-up")
    worker.start()
    worker.join()
    if result:
        e = result[0]
        raise NetnsError(f"could not bring up loopback in the network namespace of pid {pid}: {e}") from e
