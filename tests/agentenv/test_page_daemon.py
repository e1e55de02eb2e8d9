"""The page daemon's readiness: a restore may connect only once the daemon listens, not when its socket
file appears (CRIU binds, then listens; a connect between the two is refused, which failed a restore)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from agentenv.backend.page_daemon import SOCKET, PageDaemon, listening

# binds the socket, waits, then listens: the window in which CRIU's own daemon refuses connections
_BIND_THEN_LISTEN = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
time.sleep(float(sys.argv[2]))
s.listen(10)
time.sleep(30)
"""


def test_the_wait_ends_when_the_daemon_listens_not_when_its_socket_file_appears(tmp_path):
    daemon = PageDaemon(tmp_path, tmp_path)
    daemon.proc = subprocess.Popen([sys.executable, "-c", _BIND_THEN_LISTEN, str(tmp_path / SOCKET), "0.8"])
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / SOCKET).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / SOCKET).exists() and not listening(daemon.proc.pid)
        daemon.wait_listening(10)
        assert listening(daemon.proc.pid)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(tmp_path / SOCKET))  # refused if the wait ended at the bind
    finally:
        daemon.kill()


def test_a_process_without_a_listening_socket_is_not_listening(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not listening(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not listening(proc.pid)  # gone
