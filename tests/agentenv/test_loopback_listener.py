"""`Sandbox.loopback_listener`: a socket of the host listening on a sandbox's loopback (the sandbox has no
network device), which the sandbox's programs reach; a pause neither dumps nor drops it, a fork has a
network namespace of its own, without it."""

from __future__ import annotations

import socket
import threading

import pytest

from agentenv.errors import InvalidArgument
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker

PORT = 4150
CONNECT = (f"import socket; print(socket.create_connection(('127.0.0.1', {PORT}), timeout=5)"
           ".recv(64).decode())")


def answer_once(listener: socket.socket, text: str) -> threading.Thread:
    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(text.encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_host_listener_on_the_loopback_outlives_a_pause_but_not_a_fork(make_sandbox):
    sb = make_sandbox()
    with sb.loopback_listener(PORT) as listener:
        listener.setblocking(True)
        listener.settimeout(30)
        namespace = sb.network_namespace()
        assert namespace is not None
        served = answer_once(listener, "from the host")
        assert sb.exec(["python3", "-S", "-c", CONNECT]).stdout.strip() == "from the host"
        served.join(10)
        assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]

        sb.pause()  # no process of the sandbox holds the listener: CRIU does not meet it
        assert sb.network_namespace() is None
        sb.resume()
        if runtime().backend.restores_into_running:  # the warm shell kept its namespace, and so the listener
            assert sb.network_namespace() == namespace
            served = answer_once(listener, "after the pause")
            assert sb.exec(["python3", "-S", "-c", CONNECT]).stdout.strip() == "after the pause"
            served.join(10)

        (fork,) = sb.fork(1)
        assert fork.network_namespace() not in (None, namespace)
        refused = fork.exec(["python3", "-S", "-c", CONNECT])
        assert refused.exit_code != 0 and "Connection refused" in refused.stderr


def test_a_bad_port_is_refused_by_name(sandbox):
    for port in (0, 65536, True, "80"):
        with pytest.raises(InvalidArgument, match="port must be an integer from 1 to 65535"):
            sandbox.loopback_listener(port)
