"""AgentENV's guest agent: what the host talks to inside a sandbox's microVM.

It runs as PID 1 of the sandbox's PID namespace with the guest's python3 and the standard library only
(copied into the initramfs, never imported on the host), outside the sandbox's cgroup so a command at its
limits cannot stall it. The host speaks a small framed protocol to it over virtio-serial ports.

Design: docs/design/sandboxes.md#agentenv-backend-microvm-guest-agent.
"""

import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

HEADER = struct.Struct(">IB")
HELLO = b"\x00\xffAGENTENV-HELLO "    # a connection's first line, with a nonce, answered by WELCOME + nonce
WELCOME = b"\x00\xffAGENTENV-WELCOME "
STDIN, STDOUT, STDERR, JSON = 0, 1, 2, 3
CHUNK = 64 * 1024
CGROUP = "/sys/fs/cgroup"
SANDBOX_CGROUP = CGROUP + "/sandbox"   # every command: the sandbox's limits
AGENT_CGROUP = CGROUP + "/agent"       # this agent: outside them (a command at its limit cannot stall it)
RUNTIME_DIR = "/run/agentenv"
SHELL_ARGV = ["sh", "-s", "--", "agentenv-session"]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KILL_GRACE_S = 2.0          # TERM at the deadline, KILL this long after (as coreutils `timeout -k 2`)
HOST_GRACE_S = 5.0          # then every process still holding the command's pipes is killed
MS_RDONLY, MS_REMOUNT, MS_NOSUID, MS_NODEV, MS_BIND, MNT_DETACH = 1, 32, 2, 4, 4096, 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 4, 24, 38
RNDADDENTROPY, RNDRESEEDCRNG = 0x40085203, 0x5207
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1

libc = ctypes.CDLL(None, use_errno=True)
state = {"marker": "", "configured": False, "uid": 0, "gid": 0, "workspace": "/", "join_fd": -1,
         "cgroup_fd": -1, "cap_drop": [], "no_new_privs": False}
limited = threading.local()     # `limit_this_thread` ran on this thread
exits = {}                      # pid -> exit status (as subprocess reports it), filled by the main thread
expected = set()                # pids whose status a request waits for (see `reap`)
exits_cond = threading.Condition()
shells = {}                     # pid -> Command, every session shell running now
launched = {}                   # pid -> (folder, keeper pid or 0): detached commands (`op_launch`)
shells_lock = threading.Lock()
ports = []


def log(*args):
    print("agentenv-agent:", *args, file=sys.stderr, flush=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags=0, data=""):
    _check(libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                      ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def prctl(option, arg):
    _check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


# ---- ports ------------------------------------------------------------------------------------------------
class Disconnected(Exception):
    """The host side of the port went away."""


class Port:
    def __init__(self, name, dev):
        self.name = name
        self.fd = os.open(dev, os.O_RDWR | os.O_NONBLOCK)
        fcntl.fcntl(self.fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_ASYNC)
        self.wake = threading.Condition()
        self.buf = bytearray()
        self.synced = False

    def connected(self):
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return not any(ev & select.POLLHUP for _fd, ev in p.poll(0))

    def wait_connected(self):
        while not self.connected():
            with self.wake:
                self.wake.wait(5.0)

    def reset(self):
        """After a connection ended: the next one starts with its hello (what the old one left unread, here
        or still in the kernel's buffers, is skipped up to it)."""
        i = self.buf.find(HELLO)
        del self.buf[:i if i >= 0 else len(self.buf)]
        self.synced = False

    def _sync(self):
        """Drop everything before the connection's hello line; answer it (no frame: raw bytes)."""
        while True:
            i = self.buf.find(HELLO)
            if i >= 0:
                end = self.buf.find(b"\n", i)
                if end >= 0:
                    nonce = bytes(self.buf[i + len(HELLO):end])
                    del self.buf[:end + 1]
                    self.synced = True
                    self.send_raw(WELCOME + nonce + b"\n")
                    return
                del self.buf[:i]
            else:
                del self.buf[:max(0, len(self.buf) - len(HELLO))]
            self.wait_readable()
            self.fill()

    def wait_readable(self):
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        p.poll()

    def fill(self):
        """Read what is there (the caller polled); Disconnected at the end of the connection."""
        try:
            data = os.read(self.fd, CHUNK)
        except BlockingIOError:
            return
        except OSError as e:
            raise Disconnected(str(e)) from None
        if not data:
            raise Disconnected("eof")
        self.buf += data

    def frame(self):
        """A complete frame already buffered, or None. Disconnected when a new connection's hello arrived
        (its host closed this one and another took the port before this thread noticed)."""
        if HELLO in self.buf:
            raise Disconnected("a new connection began")
        if len(self.buf) < HEADER.size:
            return None
        size, kind = HEADER.unpack_from(self.buf)
        if len(self.buf) < HEADER.size + size:
            return None
        payload = bytes(self.buf[HEADER.size:HEADER.size + size])
        del self.buf[:HEADER.size + size]
        return kind, payload

    def read_frame(self):
        if not self.synced:
            self._sync()
        while True:
            f = self.frame()
            if f is not None:
                return f
            self.wait_readable()
            self.fill()

    def send(self, kind, payload=b""):
        self.send_raw(HEADER.pack(len(payload), kind) + payload)

    def send_raw(self, raw):
        data = memoryview(raw)
        while data:
            try:
                n = os.write(self.fd, data)
                data = data[n:]
                continue
            except BlockingIOError:
                pass
            except OSError as e:
                raise Disconnected(str(e)) from None
            p = select.poll()
            p.register(self.fd, select.POLLOUT)
            for _fd, ev in p.poll(1000):
                if ev & select.POLLHUP:
                    raise Disconnected("hang-up while writing")

    def answer(self, obj):
        self.send(JSON, json.dumps(obj).encode())


# ---- processes --------------------------------------------------------------------------------------------
def reap():
    """SIGCHLD: collect every child that ended. A command someone waits for gets its status in `exits`, a
    detached one its `exit` file; the rest (keepers, the orphans this namespace's init adopts) go. PIDs
    are reused quickly in a small namespace, so only statuses of children started and not yet forgotten
    are kept (`popen` registers a child under the same lock, before its status can be collected)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with exits_cond:
            done = launched.pop(pid, None)
            if pid in expected:
                exits[pid] = code
                exits_cond.notify_all()
        if done is not None:
            finish_launched(done, code)


def forget(pid):
    """The status of child `pid` is no longer wanted (its command's request ended)."""
    with exits_cond:
        expected.discard(pid)
        exits.pop(pid, None)


def as_shell_status(code):
    """A status as a shell reports it: 128 + N after signal N."""
    return 128 - code if code < 0 else code


def join_sandbox():
    """In a command's child process, before its exec: into the sandbox's cgroup, through the descriptor the
    agent opened (the kernel checks the opener's rights), so that no process of it ever runs outside."""
    os.write(state["join_fd"], b"0")


def limit_this_thread():
    """The sandbox's capability bounding set and no-new-privileges on the calling thread, which its
    children inherit (both are per thread in Linux: each thread that starts commands applies them once)."""
    if not state["configured"] or getattr(limited, "done", False):
        return
    for cap in state["cap_drop"]:
        prctl(PR_CAPBSET_DROP, cap)
    if state["no_new_privs"]:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
    limited.done = True


def popen(argv, *, uid, gid, detached=None, waited=True, **kw):
    """subprocess.Popen as `uid`:`gid` (no supplementary groups) in the sandbox's cgroup, its capabilities
    bounded; registered for `reap` (`detached`: what `finish_launched` needs at its end; `waited`: a request
    waits for its status)."""
    limit_this_thread()
    ids = {} if (uid, gid) == (os.getuid(), os.getgid()) else {"user": uid, "group": gid, "extra_groups": []}
    with exits_cond:
        proc = subprocess.Popen(argv, preexec_fn=join_sandbox, **ids, **kw)  # noqa: PLW1509 - join_sandbox
        if detached is not None:
            launched[proc.pid] = detached
        elif waited:
            expected.add(proc.pid)
    proc.returncode = 0  # never waited for through Popen: the main thread reaps every child
    return proc


def spawn(argv, *, env, cwd, uid, gid, stdin):
    """Start argv in a process group of its own, its outputs on pipes."""
    return popen(argv, uid=uid, gid=gid, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                 env=env, process_group=0, close_fds=True)


def holders(pipes):
    """Processes holding any of these pipes (the command, its children, background jobs that kept them).
    A child of this agent that is still between its fork and its exec holds copies of all the agent's
    descriptors, these pipes among them: it is not one of them (it is about to become another command)."""
    found = []
    with open("/proc/self/cmdline", "rb") as f:
        agent = f.read()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if f.read() == agent:
                    continue
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") in pipes:
                    found.append(int(name))
                    break
            except OSError:
                continue
    return found


def kill_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Output:
    """One output stream sent to the host as frames, kept up to `limit` bytes (None: all); the rest is
    counted and dropped, so the command is never blocked by a full pipe."""

    def __init__(self, port, kind, limit):
        self.port, self.kind, self.limit, self.sent, self.total = port, kind, limit, 0, 0

    def add(self, data):
        self.total += len(data)
        room = len(data) if self.limit is None else self.limit - self.sent
        part = data[:room] if room > 0 else b""
        for i in range(0, len(part), CHUNK):
            self.port.send(self.kind, part[i:i + CHUNK])
        self.sent += len(part)

    @property
    def truncated(self):
        return self.limit is not None and self.total > self.limit


class Command:
    """A started command whose outputs go to the host until both end and it exited; its stdin is fed from
    the port. At the deadline its group gets TERM, KILL_GRACE_S later KILL, HOST_GRACE_S after that every
    process still holding its pipes is killed (as `timeout -k` and the host's backstop do for containers).
    A `kill` request kills it and what holds its pipes; so does the host going away."""

    def __init__(self, port, proc, *, timeout_s, limit, has_stdin):
        self.port, self.proc = port, proc
        self.outputs = [Output(port, STDOUT, limit), Output(port, STDERR, limit)]
        self.open = {proc.stdout.fileno(): self.outputs[0], proc.stderr.fileno(): self.outputs[1]}
        self.files = {proc.stdout.fileno(): proc.stdout, proc.stderr.fileno(): proc.stderr}
        for fd in self.open:
            os.set_blocking(fd, False)
        self.stdin_fd = proc.stdin.fileno() if proc.stdin else None
        if self.stdin_fd is not None:
            os.set_blocking(self.stdin_fd, False)
        self.pending = bytearray()
        self.stdin_eof = not has_stdin
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.stage = 0        # 1: TERM sent, 2: KILL sent, 3: holders of its pipes killed
        self.code = None

    def run(self):
        """(exit status as a shell reports it, timed out, truncated)."""
        try:
            return self._run()
        finally:
            forget(self.proc.pid)

    def _run(self):
        while self.open or self.code is None:
            if self.code is None:
                with exits_cond:
                    if not self.open and self.stdin_fd is None:  # only the exit is left to wait for
                        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
                        exits_cond.wait_for(lambda: self.proc.pid in exits, left)
                    self.code = exits.pop(self.proc.pid, None)
                if self.code is not None and not self.open:
                    break
            self._step()
        if self.stdin_fd is not None:
            self.proc.stdin.close()
        timed_out = self.stage > 0
        status = (124 if self.stage == 1 else 137) if timed_out else as_shell_status(self.code)
        return status, timed_out, any(o.truncated for o in self.outputs)

    def _step(self):
        self._frames()  # what came with the request itself
        poller = select.poll()
        for fd in self.open:
            poller.register(fd, select.POLLIN)
        poller.register(self.port.fd, select.POLLIN)
        if self.stdin_fd is not None and self.pending:
            poller.register(self.stdin_fd, select.POLLOUT)
        wait = 50 if not self.open else -1   # outputs closed: the exit comes through the main thread
        if self.deadline is not None:
            left = max(0, int((self.deadline - time.monotonic()) * 1000) + 1)
            wait = left if wait < 0 else min(wait, left)
        for fd, _ev in poller.poll(wait):
            if fd in self.open:
                self._read(fd)
            elif fd == self.port.fd:
                self._from_host()
            elif fd == self.stdin_fd:
                self._feed()
        if self.stdin_fd is not None and self.stdin_eof and not self.pending:
            self.proc.stdin.close()
            self.stdin_fd = None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self._escalate()

    def _read(self, fd):
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        if data:
            self.open[fd].add(data)
        else:
            del self.open[fd]
            self.files.pop(fd).close()  # through its file object, which would otherwise close it again

    def _from_host(self):
        try:
            self.port.fill()
        except Disconnected:
            self.kill()
            raise
        self._frames()

    def _frames(self):
        """Act on the frames the port has buffered (stdin, `kill`)."""
        while (f := self.port.frame()) is not None:
            kind, payload = f
            if kind == STDIN and self.stdin_fd is not None and not self.stdin_eof:
                if payload:
                    self.pending += payload
                else:
                    self.stdin_eof = True
            elif kind == JSON and json.loads(payload).get("op") == "kill":
                self.kill()

    def pipes(self):
        """The command's pipes whose ends here are still open (a closed pipe's name may be reused)."""
        fds = list(self.open) + ([self.stdin_fd] if self.stdin_fd is not None else [])
        names = set()
        for fd in fds:
            try:
                names.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        return names

    def kill(self):
        """SIGKILL the command (while it is not reaped: its pid is its own) and what holds its pipes."""
        victims = set(holders(self.pipes())) | ({self.proc.pid} if self.code is None else set())
        for p in victims:
            try:
                if p == self.proc.pid or os.getpgid(p) == p:
                    os.killpg(p, signal.SIGKILL)
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _feed(self):
        try:
            del self.pending[:os.write(self.stdin_fd, self.pending)]
        except BlockingIOError:
            pass
        except OSError:  # the command closed its stdin: the rest is dropped
            self.pending.clear()
            self.stdin_eof = True

    def _escalate(self):
        if self.code is not None and not self.open:
            return
        self.stage += 1
        if self.stage == 1:
            if self.code is None:
                kill_group(self.proc.pid, signal.SIGTERM)
            self.deadline = time.monotonic() + KILL_GRACE_S
        elif self.stage == 2:
            if self.code is None:
                kill_group(self.proc.pid, signal.SIGKILL)
            self.deadline = time.monotonic() + HOST_GRACE_S
        else:
            self.kill()
            self.deadline = time.monotonic() + 1.0


def command_env(extra, home):
    env = {"PATH": PATH, "HOSTNAME": socket.gethostname(), "HOME": home}
    env.update(extra or {})
    return env


def op_exec(port, req):
    uid, gid = req.get("uid", state["uid"]), req.get("gid", state["gid"])
    cwd = req.get("cwd") or state["workspace"]
    env = command_env(req.get("env"), state["workspace"])
    t0 = time.monotonic()
    try:
        proc = spawn(req["argv"], env=env, cwd=cwd, uid=uid, gid=gid,
                     stdin=subprocess.PIPE if req.get("stdin") else subprocess.DEVNULL)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
        if e.filename == cwd and not isinstance(e, PermissionError):
            why, code = f"chdir to cwd ({cwd!r}) failed: {e.strerror.lower()}", 126
        elif isinstance(e, FileNotFoundError):
            why, code = f"exec: {req['argv'][0]!r}: executable file not found in $PATH", 127
        else:
            why, code = f"exec: {req['argv'][0]!r}: {e.strerror.lower()}", 126
        if req.get("stdin"):
            while port.read_frame() != (STDIN, b""):
                pass
        port.send(STDERR, f"agentenv: unable to start the command: {why}\n".encode())
        port.answer({"exit_code": code, "timed_out": False, "truncated": False,
                     "duration_s": time.monotonic() - t0})
        return
    command = Command(port, proc, timeout_s=float(req["timeout_s"]), limit=int(req["output_limit"]),
                      has_stdin=bool(req.get("stdin")))
    code, timed_out, truncated = command.run()
    port.answer({"exit_code": code, "timed_out": timed_out, "truncated": truncated,
                 "duration_s": time.monotonic() - t0})


def op_shell(port, req):
    uid, gid = req.get("uid", state["uid"]), req.get("gid", state["gid"])
    proc = spawn(SHELL_ARGV, env=command_env(None, state["workspace"]), cwd=state["workspace"], uid=uid,
                 gid=gid, stdin=subprocess.PIPE)
    command = Command(port, proc, timeout_s=None, limit=None, has_stdin=True)
    with shells_lock:
        shells[proc.pid] = command
    port.answer({"pid": proc.pid})
    try:
        code = command.run()[0]
    finally:
        with shells_lock:
            shells.pop(proc.pid, None)
    port.answer({"exit_code": code})


def op_end_shells(port, req):
    with shells_lock:
        running = list(shells.values())
    for command in running:
        command.kill()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with shells_lock:
            if not any(c.proc.pid in shells for c in running):
                break
        time.sleep(0.005)
    port.answer({"count": len(running)})


# ---- files ------------------------------------------------------------------------------------------------
class SandboxUser:
    """File access as the sandbox's user, for the calling thread only (Linux keeps the file-system uid per
    thread): the host's file requests get no more rights than the sandbox's own processes."""

    def __enter__(self):
        self.ids = state["uid"], state["gid"]
        if self.ids != (0, 0):
            libc.setfsgid(self.ids[1])
            libc.setfsuid(self.ids[0])
        return self

    def __exit__(self, *exc):
        if self.ids != (0, 0):
            libc.setfsuid(0)
            libc.setfsgid(0)


def error_answer(port, e):
    port.answer({"error": errno.errorcode.get(e.errno or 0, "EIO"), "message": str(e)})


def op_read(port, req):
    """Bytes of a file from `offset`, at most `limit` (streamed as stdout frames); the file's size."""
    with SandboxUser():
        try:
            fd = os.open(req["path"], os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            return error_answer(port, e)
    try:
        size = os.fstat(fd).st_size
        left = int(req.get("limit", size))
        os.lseek(fd, int(req.get("offset", 0)), os.SEEK_SET)
        while left > 0:
            data = os.read(fd, min(CHUNK, left))
            if not data:
                break
            port.send(STDOUT, data)
            left -= len(data)
    finally:
        os.close(fd)
    port.answer({"size": size})


def op_read_many(port, req):
    """For each path: its size and its bytes from the given offset (at most `limit`, as stdout frames in
    the order of `paths`); null for a path with no file."""
    out = {}
    limit = int(req["limit"])
    for path, offset in req["offsets"].items():
        try:
            with SandboxUser():
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            out[path] = None
            continue
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):  # a FIFO (a process's stdin): it exists, nothing to read
                data = b""
            elif size == 0:  # a file of /proc or /sys: its size is what it reads
                data = os.pread(fd, limit + int(offset), 0)
                size, data = len(data), data[int(offset):]
            else:
                data = os.pread(fd, max(0, min(limit, size - int(offset))), int(offset))
        finally:
            os.close(fd)
        for i in range(0, len(data), CHUNK):
            port.send(STDOUT, data[i:i + CHUNK])
        out[path] = [size, len(data)]
    port.answer({"files": out})


def op_write(port, req):
    """Write the stdin frames into a file (replaced), or with `fifo` into a named pipe that must have a
    reader (never blocking: ETIMEDOUT when the reader does not read within `timeout_s`)."""
    fifo = bool(req.get("fifo"))
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | (0 if fifo else os.O_CREAT | os.O_TRUNC)
    error, fd = None, None
    try:
        with SandboxUser():
            fd = os.open(req["path"], flags, int(req.get("mode", 0o644)))
    except OSError as e:
        error = e
    deadline = time.monotonic() + float(req.get("timeout_s", 10.0))
    while True:
        kind, payload = port.read_frame()
        if kind != STDIN or not payload:
            break
        view = memoryview(payload)
        while fd is not None and view and error is None:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    error = OSError(errno.ETIMEDOUT, "the reader did not read in time")
                time.sleep(0.005)
            except OSError as e:
                error = e
    if fd is not None:
        os.close(fd)
    if error is not None:
        return error_answer(port, error)
    port.answer({"ok": True})


def op_listdir(port, req):
    try:
        with SandboxUser():
            names = sorted(os.listdir(req["path"]))
    except OSError as e:
        return error_answer(port, e)
    port.answer({"names": names})


def op_tree_usage(port, req):
    """Bytes of the files below a directory (at most 100000 files counted) and its file system's size."""
    total = files = 0
    with SandboxUser():
        for dirpath, _dirs, names in os.walk(req["path"]):
            for name in names:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue
                files += 1
            if files >= 100000:
                break
        try:
            st = os.statvfs(req["path"])
        except OSError as e:
            return error_answer(port, e)
    port.answer({"bytes": total, "total": st.f_blocks * st.f_frsize})


# ---- detached commands ------------------------------------------------------------------------------------
def op_launch(port, req):
    """Start a command detached, leaving what `agentenv serve`'s launcher and wrapper scripts leave
    (agentenv/server/procs.py): under `base`, a folder `t.<tag>` with `pid`, `out`, `err`, with stdin the
    FIFO `in` whose write end a `sleep infinity` keeper holds (its pid in `keeper`), the link `p.<pid>`, and
    once the command ended its status in `exit` (written here, when it is reaped). No shell and no wrapper
    process: the command is the only process of its own (plus the keeper)."""
    base, folder = req["base"], f"{req['base']}/t.{req['tag']}"
    uid, gid = state["uid"], state["gid"]
    env = command_env(req.get("env"), state["workspace"])
    opened = []
    try:
        with SandboxUser():
            os.makedirs(base, exist_ok=True)
            os.mkdir(folder)
            keeper = 0
            stdin = subprocess.DEVNULL
            if req.get("stdin"):
                os.mkfifo(f"{folder}/in")
                holder = os.open(f"{folder}/in", os.O_RDWR)   # a FIFO opened read-write never blocks
                opened.append(holder)
                stdin = os.open(f"{folder}/in", os.O_RDONLY | os.O_NONBLOCK)
                opened.append(stdin)
                os.set_blocking(stdin, True)
                keeper = popen(["sleep", "infinity"], uid=uid, gid=gid, stdin=subprocess.DEVNULL,
                               stdout=holder, stderr=subprocess.DEVNULL, env=env, cwd="/",
                               start_new_session=True, waited=False).pid
                write_small(f"{folder}/keeper", f"{keeper}\n")
            out = os.open(f"{folder}/out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            opened.append(out)
            err = os.open(f"{folder}/err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            opened.append(err)
        try:
            proc = popen(req["argv"], uid=uid, gid=gid, stdin=stdin, stdout=out, stderr=err, env=env,
                         cwd=req.get("cwd") or None, start_new_session=True, close_fds=True,
                         detached=(folder, keeper))
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            if keeper:
                kill_group(keeper, signal.SIGKILL)
            return error_answer(port, e)
        with SandboxUser():
            write_small(f"{folder}/pid", f"{proc.pid}\n")
            os.symlink(f"t.{req['tag']}", f"{base}/p.{proc.pid}")
    except OSError as e:
        return error_answer(port, e)
    finally:
        for fd in opened:
            os.close(fd)
    port.answer({"pid": proc.pid})


def write_small(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def finish_launched(detached, code):
    """A detached command ended: stop its stdin's keeper and write its status into `exit` (atomically)."""
    folder, keeper = detached
    if keeper:
        kill_group(keeper, signal.SIGTERM)
    try:
        with SandboxUser():
            write_small(f"{folder}/exit.tmp", f"{as_shell_status(code)}\n")
            os.replace(f"{folder}/exit.tmp", f"{folder}/exit")
    except OSError as e:
        log("could not record the exit of a command in", folder, e)


# ---- the sandbox ------------------------------------------------------------------------------------------
def cgroup_write(name, value):
    """Through the agent's own, detached mount of the cgroup file system (the sandbox's is read-only)."""
    fd = os.open(name, os.O_WRONLY, dir_fd=state["cgroup_fd"])
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def cgroup_read(name):
    try:
        with open(f"{SANDBOX_CGROUP}/{name}") as f:
            return f.read()
    except OSError:
        return ""


def op_configure(port, req):
    """The sandbox's config, once, right after its first start (the snapshot it starts from is shared)."""
    if state["configured"]:
        return port.answer({"error": "EALREADY", "message": "the sandbox is configured already"})
    uid, gid = int(req["uid"]), int(req["gid"])
    ws = req["workspace"]
    os.makedirs(ws, exist_ok=True)
    mount("tmpfs", ws, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=755,uid={uid},gid={gid}")
    for path, opts in sorted(req.get("tmpfs", {}).items()):
        os.makedirs(path, exist_ok=True)
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    os.makedirs(RUNTIME_DIR, mode=0o755, exist_ok=True)
    write_runtime({"sandbox-id": req["sandbox_id"], "seed": str(req["seed"])})
    cgroup_write("pids.max", str(int(req["pids_max"])) if req.get("pids_max") else "max")
    if req.get("memory_max"):
        cgroup_write("memory.max", str(int(req["memory_max"])))
        cgroup_write("memory.swap.max", "0")
    if req.get("cpu_max"):
        cgroup_write("cpu.max", req["cpu_max"])
    # what the sandbox's root could otherwise write: its own limits, the kernel's settings (as Docker
    # mounts /sys and /proc/sys read-only in a container)
    for path in (CGROUP, "/sys"):
        mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    mount("/proc/sys", "/proc/sys", None, MS_BIND)
    mount("none", "/proc/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    if req.get("read_only"):
        mount("none", "/", None, MS_REMOUNT | MS_RDONLY)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    keep = set(req.get("cap_keep", []))
    state.update(uid=uid, gid=gid, workspace=ws, configured=True,
                 cap_drop=[cap for cap in range(last + 1) if cap not in keep],
                 no_new_privs=bool(req.get("no_new_privs")))
    reseed(req.get("entropy", ""))
    port.answer({"ok": True})


def write_runtime(files):
    for name, value in files.items():
        tmp = f"{RUNTIME_DIR}/.{name}.tmp"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(value)
        os.replace(tmp, f"{RUNTIME_DIR}/{name}")  # a link planted there is replaced, never followed


def reseed(entropy_hex):
    """Mix the host's random bytes into the kernel's pool and reseed its generator (forks share memory)."""
    if not entropy_hex:
        return
    data = bytes.fromhex(entropy_hex)
    fd = os.open("/dev/urandom", os.O_WRONLY)
    try:
        buf = struct.pack("ii", len(data) * 8, len(data)) + data
        arg = ctypes.create_string_buffer(buf, len(buf))
        fcntl.ioctl(fd, RNDADDENTROPY, arg)
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        except OSError:
            pass
    finally:
        os.close(fd)


def op_mark(port, req):
    """Before a snapshot: remember the marker a restore must show (it lives in the snapshot's memory)."""
    state["marker"] = req["marker"]
    port.answer({"ok": True})


def op_resumed(port, req):
    """After a restore or in a fork: the sandbox's identity, a fresh seed, the host's clock and entropy;
    answers the restore marker the snapshot held and keeps the next one (the marker of its next pause)."""
    try:
        time.clock_settime(time.CLOCK_REALTIME, float(req["time"]))
    except OSError as e:
        log("could not set the clock:", e)
    reseed(req.get("entropy", ""))
    if state["configured"]:
        write_runtime({"sandbox-id": req["sandbox_id"], "seed": str(req["seed"])})
    found, state["marker"] = state["marker"], req.get("marker", state["marker"])
    port.answer({"marker": found})


def op_usage(port, req):
    stat = dict(line.split() for line in cgroup_read("memory.stat").splitlines() if line)
    events = dict(line.split() for line in cgroup_read("memory.events").splitlines() if line)
    cpu = dict(line.split() for line in cgroup_read("cpu.stat").splitlines() if line)
    pids = int(cgroup_read("pids.current") or 0)
    port.answer({"memory_bytes": int(stat.get("anon", 0)) + int(stat.get("shmem", 0)),
                 "oom_kills": int(events.get("oom_kill", 0)), "pids": max(pids, 0),
                 "cpu_s": int(cpu.get("usage_usec", 0)) / 1e6})


def op_ps(port, req):
    procs = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
            uid = os.stat(f"/proc/{name}").st_uid
        except (OSError, IndexError):
            continue
        procs.append({"pid": int(name), "ppid": int(fields[1]), "pgid": int(fields[2]),
                      "state": fields[0].decode(), "uid": uid, "argv": argv})
    port.answer({"processes": sorted(procs, key=lambda p: p["pid"])})


def op_signal(port, req):
    """Signal a process (or, with a negative pid, a process group) of the sandbox."""
    try:
        os.kill(int(req["pid"]), int(req["signal"]))
    except OSError as e:
        return error_answer(port, e)
    port.answer({"ok": True})


def op_ping(port, req):
    port.answer({"pid": os.getpid(), "configured": state["configured"], "ports": len(ports)})


OPS = {"exec": op_exec, "shell": op_shell, "end_shells": op_end_shells, "read": op_read, "write": op_write,
       "read_many": op_read_many, "listdir": op_listdir, "tree_usage": op_tree_usage,
       "configure": op_configure, "mark": op_mark, "resumed": op_resumed, "usage": op_usage, "ps": op_ps,
       "signal": op_signal, "ping": op_ping, "launch": op_launch}


def serve(port):
    """One request per connection: hello, the request (its input, its answer), then the next hello."""
    while True:
        port.wait_connected()
        try:
            while True:
                kind, payload = port.read_frame()
                if kind != JSON:
                    continue  # stray input of a request that ended
                req = json.loads(payload)
                handler = OPS.get(req.get("op"))
                try:
                    if handler is None:
                        port.answer({"error": "EINVAL", "message": f"unknown op {req.get('op')!r}"})
                    else:
                        handler(port, req)
                except Disconnected:
                    raise
                except Exception as e:  # noqa: BLE001 - the host gets every failure as an answer
                    log(f"{req.get('op')} failed:", repr(e))
                    port.answer({"error": "EIO", "message": f"{type(e).__name__}: {e}"})
                port.reset()  # the request is answered: its connection has nothing more to say
        except Disconnected:
            port.reset()


# ---- start ------------------------------------------------------------------------------------------------
def setup_guest():
    prctl(PR_SET_DUMPABLE, 0)   # the sandbox's root (same uid) cannot ptrace or read this process
    # (no oom_score_adj: the commands would inherit it; the sandbox's OOM kills stay in its cgroup, where
    # the agent is not, and its memory limit leaves the guest's overhead free)
    # The agent writes the cgroups through a mount of its own, detached from every path once open: the
    # sandbox's /sys/fs/cgroup becomes read-only at `configure` (a mount with a writer cannot).
    private = "/run/agentenv-guest/cgroup"
    os.makedirs(private, mode=0o700, exist_ok=True)
    mount("cgroup2", private, "cgroup2", MS_NOSUID | MS_NODEV)
    with open(f"{private}/cgroup.subtree_control", "w") as f:
        f.write("+memory +pids +cpu")
    for group in ("sandbox", "agent"):
        os.makedirs(f"{private}/{group}", exist_ok=True)
    with open(f"{private}/agent/cgroup.procs", "w") as f:
        f.write("0")
    state["cgroup_fd"] = os.open(f"{private}/sandbox", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    state["join_fd"] = os.open(f"{private}/sandbox/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    _check(libc.umount2(private.encode(), MNT_DETACH), f"umount {private}")
    os.rmdir(private)
    if not os.path.exists(f"{CGROUP}/cgroup.controllers"):
        mount("cgroup2", CGROUP, "cgroup2", MS_NOSUID | MS_NODEV)
    socket.sethostname("sandbox")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # loopback up (no other interface exists)
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))
    os.umask(0o022)
    os.chdir("/")


def main():
    setup_guest()
    base = "/sys/class/virtio-ports"
    for dev in sorted(os.listdir(base)):
        with open(f"{base}/{dev}/name") as f:
            name = f.read().strip()
        if name.startswith("agentenv."):
            ports.append(Port(name, f"/dev/{dev}"))

    def on_signal(signo, _frame):
        if signo == signal.SIGCHLD:
            reap()
        else:
            for port in ports:
                with port.wake:
                    port.wake.notify_all()

    # Handlers run in this thread, woken through the wakeup pipe whichever thread the kernel picked.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, on_signal)
    signal.signal(signal.SIGIO, on_signal)
    for port in ports:
        threading.Thread(target=serve, args=(port,), name=port.name, daemon=True).start()
    with open("/dev/console", "w") as console:
        print(f"AGENTENV-READY {len(ports)}", file=console, flush=True)
    while True:
        os.read(wake_r, 512)
        reap()  # a SIGCHLD can stand for several children


if __name__ == "__main__":
    main()
