"""Work in a sandbox's network namespace from the host: bring up its loopback, listen on it.

Sandboxes without a network skip Docker's prestart hook, which used to do this after a CRIU restore; the
restore calls `loopback_up` right after Docker returns, in a short-lived thread (`setns` moves only it).
`listen_on_loopback` makes a socket there that the host holds (`Sandbox.loopback_listener`).

Design: docs/design/sandboxes.md#agentenv-backend-netns.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"  # struct ifreq: name, then ifr_flags (short) in the union
T = TypeVar("T")


class NetnsError(OSError):
    """Something could not be done inside a sandbox's network namespace."""


def _in_netns(netns_path: str, action: Callable[[], T], result: list) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise NetnsError(err, f"setns({netns_path}): {os.strerror(err)}")
        finally:
            os.close(fd)
        result.append(action())
    except BaseException as e:  # reported by the caller's thread
        result.append(e)


def run_in_netns(pid: int, action: Callable[[], T], what: str) -> T:
    """`action()` run inside the network namespace of process `pid` (a host pid), in a short-lived thread:
    `setns` moves only that thread, which then exits. A socket it creates stays in that namespace."""
    result: list = []
    worker = threading.Thread(target=_in_netns, args=(f"/proc/{pid}/ns/net", action, result),
                              name="netns-worker")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        e = result[0]
        raise NetnsError(f"could not {what} in the network namespace of pid {pid}: {e}") from e
    return result[0]


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def loopback_up(pid: int) -> None:
    """`ip link set lo up` inside the network namespace of process `pid` (a host pid)."""
    run_in_netns(pid, _lo_up, "bring up loopback")


def netns_id(pid: int) -> int:
    """The network namespace of process `pid` (its inode number: equal ids, the same namespace)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def listen_on_loopback(pid: int, port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` inside the network namespace of process `pid`, held by
    the calling process (non-blocking, close-on-exec)."""

    def listen() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    return run_in_netns(pid, listen, f"listen on 127.0.0.1:{port}")
