"""The terminal of a PTY process (E2B's `sandbox.pty`): a Python program that runs inside the sandbox
(its image's python3) as the process `procs` starts, so it lives, and is checkpointed, with the sandbox.

`python3 -c BRIDGE ROWS COLS CTL CMD [ARG...]` opens a pseudo-terminal, runs CMD on it as a session
leader (the terminal's size set before CMD starts), copies its stdin (the process's stdin FIFO) to the
terminal and the terminal's output to its stdout (the process's output file), and applies "ROWS COLS"
lines written to the FIFO CTL (which it creates) as the new size (SIGWINCH follows). It exits with CMD's
exit code (128 + N for signal N). Killed, it closes the terminal: the kernel hangs CMD up (SIGHUP)."""

from __future__ import annotations

BRIDGE = r"""
import fcntl, os, select, struct, sys, termios
rows, cols, ctl, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
def size(fd, r, c):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", r, c, 0, 0))
os.mkfifo(ctl)
ctlfd = os.open(ctl, os.O_RDWR | os.O_NONBLOCK)
master, slave = os.openpty()
size(master, rows, cols)  # before CMD starts, and before any resize from CTL is applied
pid = os.fork()
if pid == 0:
    try:
        os.close(master)
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        for fd in (0, 1, 2):
            os.dup2(slave, fd)
        if slave > 2:
            os.close(slave)
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(2, f"cannot run {argv[0]}: {e.strerror}\r\n".encode())
    os._exit(127)
os.close(slave)
stdin_open = True
while True:
    fds = [master, ctlfd] + ([0] if stdin_open else [])
    ready = select.select(fds, [], [])[0]
    if master in ready:
        try:
            data = os.read(master, 65536)
        except OSError:
            data = b""
        if not data:
            break
        os.write(1, data)
    if 0 in ready:
        data = os.read(0, 65536)
        if not data:
            stdin_open = False
        while data:
            data = data[os.write(master, data):]
    if ctlfd in ready:
        for line in os.read(ctlfd, 4096).decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                size(master, int(parts[0]), int(parts[1]))
status = os.waitpid(pid, 0)[1]
code = os.waitstatus_to_exitcode(status)
sys.exit(128 - code if code < 0 else code)
"""
