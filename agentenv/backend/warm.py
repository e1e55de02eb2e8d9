"""`WarmRuntime` (the `warm` backend): a pause dumps the sandbox's process tree and leaves its container
running with nothing but its init (a warm shell); a resume restores the tree into that shell, its memory
arriving lazily. docs/agentenv.md, "How pause, resume and fork work", tells the whole story.

The shell keeps namespaces, cgroup, mounts and tmpfs contents, so a resume has nothing to rebuild.

Design: docs/design/sandboxes.md#agentenv-backend-warm.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import docker

from agentenv.backend import criu_log, interrupted, ksm
from agentenv.backend.base import (
    LABEL_SANDBOX,
    RUNTIME_DIR,
    Checkpoint,
    ContainerNotRunning,
    ContainerRef,
    Settled,
)
from agentenv.backend.cgroups import cgroup_pids, read_usage
from agentenv.backend.criu_images import ids_in_use, read_pstree, renumber_root
from agentenv.backend.docker_client import docker_errors
from agentenv.backend.nsexec import bump_last_pid, host_program, run_in_mounts, start_criu
from agentenv.backend.page_daemon import PageDaemon, wait_marked
from agentenv.backend.procs import ns_pid, process_tree
from agentenv.backend.runtime import CriuRuntime, drop_host_clock_image
from agentenv.backend.shell_files import RESTORE_WORK, prepare_runtime_files
from agentenv.backend.store import ImageRecord, disk_bytes
from agentenv.errors import CheckpointError, DiskCapExceeded, RestoreNotVerified, SandboxBusy
from agentenv.faults import crash_point
from agentenv.locks import sandbox_lock

log = logging.getLogger(__name__)

INIT_PATH = f"{RUNTIME_DIR}/init"     # the init's binary, bind-mounted read-only
KDAT_PATH = "/run/criu.kdat"         # CRIU's cache of kernel facts (spares it 20-30 ms per run)
TREE = "tree"
BENIGN = ("Unable to create tun", "RLIMIT_NOFILE for self")  # CRIU logs these as errors on every run
CLEAR_TIMEOUT_S = 10.0
MIN_RESERVATION = 8 * 2**20
EMPTY_TAR_BYTES = 10240  # the archive of an empty folder: one entry and the end blocks, one tar record


class WarmRuntime(CriuRuntime):
    """Tree dumps and restores into warm shells (see the module docstring)."""

    restores_into_running = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.files = prepare_runtime_files(self.settings.runtime_dir)
        self._warm: OrderedDict[str, int] = OrderedDict()  # paused shells this process keeps up
        self._serving: dict[str, list[PageDaemon]] = {}    # image folder -> page daemons reading it
        self._last_daemon: dict[str, PageDaemon] = {}      # container -> its last restore's daemon
        self._state_lock = threading.Lock()

    # ---- containers --------------------------------------------------------------------------
    def _init_argv(self) -> tuple[list[str] | None, list[str]]:
        return [INIT_PATH], ["-P"]

    def _runtime_mounts(self) -> list[docker.types.Mount]:
        mounts = [docker.types.Mount(INIT_PATH, str(self.files.init), type="bind", read_only=True)]
        if self.files.kdat is not None:
            mounts.append(docker.types.Mount(KDAT_PATH, str(self.files.kdat), type="bind", read_only=True))
        return mounts

    # ---- pause -------------------------------------------------------------------------------
    @docker_errors
    def checkpoint(self, ref: ContainerRef, checkpoint_id: str, *, user: str) -> Checkpoint:
        info = self.api.inspect_container(ref.container)
        if not info["State"].get("Running"):
            raise ContainerNotRunning(f"its container is {info['State'].get('Status')}")
        t0 = time.perf_counter()
        self._wait_pages_in(info["Id"])
        pid = int(info["State"]["Pid"])
        rss = self.usage(ref)[0]
        processes = process_tree(pid)
        need = max(MIN_RESERVATION, int(rss * self.settings.pause_headroom))
        try:
            with self.store.reserve(info["Id"], need) as path:
                record = self._dump_tree(info, pid, path, processes)
        except CheckpointError as e:
            hint = "" if isinstance(e, DiskCapExceeded) else self._uid_hint(ref, user)
            if not hint:
                raise
            raise CheckpointError(f"{e}{hint}") from None
        self._keep_warm(ref.container, pid, record)
        return Checkpoint(id=record.name, path=str(record.path), bytes=record.image_bytes,
                          marker=record.marker, duration_s=time.perf_counter() - t0)

    def _dump_args(self, info: dict, leave: str) -> list[str]:
        args = ["dump", "-t", "1", "-D", "{0}", "-W", "{1}", "-o", "dump.log", "-v3", leave,
                "--tcp-established", "--file-locks"]
        if info["Config"].get("NetworkDisabled"):
            args += ["--network-lock", "skip"]  # nothing outside the sandbox to keep out during the dump
        return args

    def _run_criu(self, pid: int, args: list[str], dirs: list[Path], log_file: Path, what: str, *,
                  join_cgroups: bool = False, merge_pages: bool = False) -> None:
        """CRIU in the container's namespaces; CheckpointError naming `what` and CRIU's errors."""
        try:
            proc = start_criu(pid, args, dirs, join_cgroups=join_cgroups, merge_pages=merge_pages)
        except ProcessLookupError as e:
            raise ContainerNotRunning(str(e)) from None
        try:
            _out, err = proc.communicate(timeout=self.settings.op_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise CheckpointError(f"CRIU's {what} took longer than op_timeout_s="
                                  f"{self.settings.op_timeout_s:g} s and was killed") from None
        if proc.returncode != 0:
            why = criu_log.explain(log_file, skip=BENIGN) or \
                f" ({(err or b'').decode(errors='replace').strip()[-300:]})"
            raise CheckpointError(f"CRIU could not {what}{why}")

    def _dump_tree(self, info: dict, pid: int, path: Path, processes: tuple) -> ImageRecord:
        """Dump every process from the init (left stopped), seal the images (`_seal`), then kill all but
        the init. Until the record is written a failure lets the stopped processes go on."""
        work = self.store.work_dir(path)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            self._run_criu(pid, self._dump_args(info, "--leave-stopped"), [path, work], work / "dump.log",
                           "checkpoint the sandbox")
            crash_point("warm-dumped")
            stopped = cgroup_pids(pid)
            try:
                record = self._seal(info, pid, path, processes)
            except BaseException:
                _signal_all(stopped, signal.SIGCONT)  # the sandbox goes on as if never paused
                raise
            crash_point("warm-sealed")
            self._clear_shell(pid, also_continue=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return record

    def _seal(self, info: dict, pid: int, path: Path, processes: tuple) -> ImageRecord:
        """Make a finished dump restorable while its processes are still stopped: the tmpfs archives, the
        host clock image dropped, the init renumbered; the record file, written last, says it is whole."""
        tmpfs = self._archive_tmpfs(info, pid, path)
        drop_host_clock_image(path)
        _header, entries = read_pstree(path)
        if entries[0].pid == 1:  # not yet renumbered (a finished dump sealed after its caller died)
            renumber_root(path, max(ids_in_use(entries)) + 1)
        _header, entries = read_pstree(path)
        record = ImageRecord(container_id=info["Id"], name=path.name, path=path, created=time.time(),
                             image_bytes=disk_bytes(path), processes=processes, format=TREE,
                             root_pid=entries[0].pid, tmpfs=tmpfs, marker=secrets.token_hex(16))
        self.store.save(record)
        return record

    def _tmpfs_mounts(self, info: dict) -> list[str]:
        return sorted(m for m in (info["HostConfig"].get("Tmpfs") or {}) if m.rstrip("/") != RUNTIME_DIR)

    def _archive_tmpfs(self, info: dict, pid: int, path: Path) -> tuple[str, ...]:
        """`tmpfs-<i>.tar` beside the images for each tmpfs mount (read inside the container)."""
        mounts = self._tmpfs_mounts(info)
        tar = host_program("tar")
        for i, mount in enumerate(mounts):
            with open(path / f"tmpfs-{i}.tar", "wb") as out:
                try:
                    run_in_mounts(pid, tar, ["-C", mount, "--numeric-owner", "-cf", "-", "."],
                                  timeout_s=self.settings.op_timeout_s, join_cgroups=False,
                                  stdout=out.fileno())
                except subprocess.CalledProcessError as e:
                    if e.returncode != 1:  # 1: a file changed as it was read (none runs: all are stopped)
                        raise CheckpointError(f"could not archive the tmpfs at {mount}: "
                                              f"{e.stderr.decode(errors='replace').strip()[-300:]}") from None
        return tuple(mounts)

    def _unpack_tmpfs(self, pid: int, record: ImageRecord) -> None:
        tar = host_program("tar")
        for i, mount in enumerate(record.tmpfs):
            archive = record.path / f"tmpfs-{i}.tar"
            if archive.stat().st_size <= EMPTY_TAR_BYTES and _only_the_root(archive):
                continue  # an empty tmpfs: nothing to unpack
            with open(archive, "rb") as src:
                try:
                    run_in_mounts(pid, tar, ["-C", mount, "--numeric-owner", "-xpf", "-"],
                                  timeout_s=self.settings.op_timeout_s, join_cgroups=True, stdin=src.fileno())
                except subprocess.CalledProcessError as e:
                    raise CheckpointError(f"could not unpack the tmpfs at {mount}: "
                                          f"{e.stderr.decode(errors='replace').strip()[-300:]}") from None

    def _clear_shell(self, pid: int, *, also_continue: bool = False) -> None:
        """Kill every process of the container but its init (`pid`); with `also_continue` the init was left
        stopped by a dump and is let go on. Returns once only the init is left."""
        if also_continue:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + CLEAR_TIMEOUT_S
        while True:
            others = [p for p in cgroup_pids(pid) if p != pid]
            if not others:
                return
            _signal_all(others, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise CheckpointError(f"processes {others} of the sandbox did not die within "
                                      f"{CLEAR_TIMEOUT_S:g} s")
            time.sleep(0.002)

    def _keep_warm(self, container: str, pid: int, record: ImageRecord) -> None:
        """Keep the paused sandbox's shell up, within `warm_shells` and `warm_tmpfs_limit` (the shell
        holds its tmpfs contents in memory); stop the ones beyond (the least recently paused)."""
        tmpfs_bytes = sum((record.path / f"tmpfs-{i}.tar").stat().st_size for i in range(len(record.tmpfs)))
        cool: list[str] = []
        with self._state_lock:
            if tmpfs_bytes > self.settings.warm_tmpfs_limit or self.settings.warm_shells == 0:
                cool.append(container)
            else:
                self._warm[container] = pid
                self._warm.move_to_end(container)
                while len(self._warm) > self.settings.warm_shells:
                    cool.append(self._warm.popitem(last=False)[0])
        for c in cool:
            self.cool(ContainerRef(c, ""))

    @docker_errors
    def cool(self, ref: ContainerRef) -> bool:
        """Stop a paused sandbox's warm shell (no process left); False, touching nothing, unless the
        container runs its init alone and holds a checkpoint (a running sandbox may hold no process of
        its own, but it has no checkpoint), or while another process changes the sandbox's state."""
        with self._state_lock:
            self._warm.pop(ref.container, None)
        try:
            info = self.api.inspect_container(ref.container)
        except docker.errors.NotFound:
            return False
        sandbox_id = (info["Config"].get("Labels") or {}).get(LABEL_SANDBOX, "")
        try:
            with sandbox_lock(self.home / "locks", sandbox_id, timeout_s=0.0, action="cool its shell"):
                pid = int(info["State"].get("Pid") or 0)
                if not info["State"].get("Running") or self.store.latest(info["Id"]) is None \
                        or [p for p in cgroup_pids(pid) if p != pid]:
                    return False
                with contextlib.suppress(docker.errors.APIError):
                    self.api.kill(ref.container)
                    self.api.wait(ref.container, condition="not-running",
                                  timeout=int(self.settings.op_timeout_s))
                return True
        except SandboxBusy:
            return False

    def _probe_dump(self, container: str) -> None:
        info = self.api.inspect_container(container)
        pid = int(info["State"]["Pid"])
        with self.store.reserve(container, MIN_RESERVATION) as path:
            work = self.store.work_dir(path)
            work.mkdir()
            try:
                self._run_criu(pid, self._dump_args(info, "--leave-running"), [path, work],
                               work / "dump.log", "checkpoint a process of uid 1000")
            finally:
                shutil.rmtree(work, ignore_errors=True)
        self.store.delete_container(container)

    # ---- resume and fork ---------------------------------------------------------------------
    @docker_errors
    def restore(self, ref: ContainerRef, checkpoint: Checkpoint, *, sandbox_id: str) -> None:
        record = self.store.record_at(checkpoint.path)
        if record is None or record.format != TREE:
            self._restore(ref, checkpoint, sandbox_id)  # a checkpoint of a Docker backend
            return
        if record.marker != checkpoint.marker:
            raise CheckpointError(f"checkpoint {checkpoint.id} at {checkpoint.path} holds other images than "
                                  "the registry recorded; it is kept, not restored")
        info = self.api.inspect_container(ref.container)
        cold = not info["State"].get("Running")
        if cold:
            self.api.start(ref.container)
            info = self.api.inspect_container(ref.container)
        pid = int(info["State"].get("Pid") or 0)
        if not pid:
            raise CheckpointError(f"the shell of the sandbox did not start ({info['State'].get('Status')})")
        fork = record.container_id != info["Id"]
        with self._state_lock:
            self._warm.pop(ref.container, None)
        try:
            self._clear_shell(pid)  # a shell holds nothing but its init (e.g. after a failed restore)
            if cold or fork:  # a stopped shell lost its tmpfs; a fork's (or a spare's) never had it
                self._unpack_tmpfs(pid, record)
            self._restore_tree(pid, info["Id"], record, fork)
        except BaseException:
            with contextlib.suppress(CheckpointError, OSError):
                self._clear_shell(pid)
            raise
        self._cpu_baseline(ref.container).write_text(str(read_usage(pid).cpu_seconds))
        self._write_identity(ref, sandbox_id, pid=pid)

    def _cpu_baseline(self, container_id: str) -> Path:
        """The container's cgroup CPU seconds when its processes were last restored: a warm shell's cgroup
        outlives pauses, and `usage` counts from the last restore (as a fresh container's would)."""
        return self.files.logs / f"{container_id}.cpu0"

    @docker_errors
    def usage(self, ref: ContainerRef) -> tuple[int, float, int, int]:
        rss, cpu, pids, ooms = super().usage(ref)
        try:
            cpu -= float(self._cpu_baseline(ref.container).read_text())
        except (OSError, ValueError):
            pass
        return rss, max(cpu, 0.0), pids, ooms

    def _restore_tree(self, pid: int, container: str, record: ImageRecord, fork: bool) -> None:
        work = self.files.scratch / f"{RESTORE_WORK}{uuid.uuid4().hex[:12]}"
        work.mkdir(parents=True)
        daemon: PageDaemon | None = None
        try:
            if self.settings.lazy_pages:
                daemon = PageDaemon(record.path, work, self.files.kdat).start()
            bump_last_pid(pid, record.root_pid, self.settings.op_timeout_s)
            args = ["restore", "-D", "{0}", "-W", "{1}", "-o", "restore.log", "-v3", "--restore-detached",
                    "--manage-cgroups=ignore", "--tcp-established", "--file-locks"]
            if daemon is not None:
                daemon.wait_listening(self.settings.op_timeout_s)
                args.append("--lazy-pages")
            merge = fork and self.settings.ksm
            if merge:
                ksm.ensure_running(self.settings)
            kept = self.restore_log(container)
            try:
                self._run_criu(pid, args, [record.path, work], work / "restore.log", "restore the sandbox",
                               join_cgroups=True, merge_pages=merge)
            finally:
                with contextlib.suppress(OSError):
                    shutil.copyfile(work / "restore.log", kept)
            if not criu_log.restore_finished(kept, 0.0):
                raise RestoreNotVerified(f"CRIU returned 0 but its log {kept} shows no finished restore")
            self._drop_init_copy(pid, record.root_pid)
        except BaseException:
            if daemon is not None:
                daemon.kill()
            shutil.rmtree(work, ignore_errors=True)
            raise
        if daemon is None:
            shutil.rmtree(work, ignore_errors=True)
            return
        daemon.reap_in_background(cleanup=work)
        with contextlib.suppress(OSError):
            daemon.write_marker(self._pages_marker(container))
        with self._state_lock:
            self._serving.setdefault(str(record.path), []).append(daemon)
            self._last_daemon[container] = daemon

    def _pages_marker(self, container_id: str) -> Path:
        """Names the page daemon of the container's last lazy restore, for a dump in another process."""
        return self.files.logs / f"{container_id}.pages"

    def restore_log(self, container_id: str) -> Path:
        """CRIU's log of the container's last restore (kept until the next one)."""
        return self.files.logs / f"{container_id}.restore.log"

    def _drop_init_copy(self, pid: int, root_pid: int) -> None:
        """Kill the restored copy of the init (PID `root_pid` in the container) and the processes of its
        own session (an older init's helpers); its other children go to the container's init."""
        copy = [p for p in cgroup_pids(pid) if ns_pid(p) == root_pid]
        if not copy:
            raise RestoreNotVerified(f"the restored tree has no task {root_pid} (the dumped init)")
        helpers = [p for p in cgroup_pids(pid) if p != pid and _session(p) == copy[0]]
        _signal_all(copy + helpers, signal.SIGKILL)

    def _wait_pages_in(self, container_id: str) -> None:
        """Before a dump (a pause, or the checkpoint a fork of a running sandbox takes): wait until the
        page daemon of the container's last lazy restore has sent its last page (one this process started,
        or one another process named in the container's marker). A dump taken while pages are still on
        their way loses them: the processes of every restore of it (the sandbox, its forks) come back with
        memory missing and crash. CheckpointError, the sandbox still running, when the daemon still sends
        after `op_timeout_s`."""
        with self._state_lock:
            daemon = self._last_daemon.get(container_id)
        if daemon is not None:
            daemon.wait_done(self.settings.op_timeout_s)
            if daemon.proc is not None and daemon.proc.poll() is None:
                raise CheckpointError("the page daemon of its last restore is still sending pages after "
                                      f"op_timeout_s={self.settings.op_timeout_s:g} s; a checkpoint now "
                                      "would lose the pages not yet in")
            if daemon.finished is None:
                log.warning("the page daemon of the last restore of container %s failed (exit %s); pages "
                            "it did not send are not in this checkpoint", container_id[:12],
                            daemon.proc.returncode if daemon.proc is not None else "?")
        if not wait_marked(self._pages_marker(container_id), self.settings.op_timeout_s):
            raise CheckpointError("the page daemon of its last restore (started by another process) is still "
                                  f"sending pages after op_timeout_s={self.settings.op_timeout_s:g} s; a "
                                  "checkpoint now would lose the pages not yet in")

    def page_fill_seconds(self, container_id: str, timeout_s: float = 60.0) -> float | None:
        """Wait until the page daemon of the container's last restore in this process sent every page:
        seconds from its start; None when it failed, still runs after `timeout_s`, or was none."""
        with self._state_lock:
            daemon = self._last_daemon.get(container_id)
        return daemon.wait_done(timeout_s) if daemon is not None else None

    # ---- after a death halfway ---------------------------------------------------------------
    @staticmethod
    def _dump_of(pid: int):
        """A dump of the container whose init is host pid `pid`: our `nsenter -t PID ... criu dump` chain."""
        want = str(pid).encode()
        return lambda argv: b"nsenter" in argv and want in argv and b"dump" in argv

    @docker_errors
    def settle(self, ref: ContainerRef, sandbox_id: str, recorded: str, checkpoint: Checkpoint | None,
               wait_s: float) -> Settled:
        try:
            info = self.api.inspect_container(ref.container)
        except docker.errors.NotFound:
            return Settled(None, note="gone")
        cid, running = info["Id"], bool(info["State"].get("Running"))
        pid = int(info["State"].get("Pid") or 0) if running else 0
        if running and interrupted.dump_traces(self.store, cid) \
                and not interrupted.wait_for_dump(self._dump_of(pid), wait_s):
            log.warning("a dump of sandbox %s still runs after %.0f s", sandbox_id, wait_s)
        if recorded == "paused":
            return self._settle_paused(pid, checkpoint)
        latest = self.store.latest(cid)
        if latest is not None and latest.format == TREE and (checkpoint is None
                                                             or Path(checkpoint.path) != latest.path):
            if running:  # the pause wrote its record, then died before (or while) it killed the tree
                self._clear_shell(pid, also_continue=True)
            return Settled("paused", interrupted.checkpoint_of(latest), note="paused")
        if not running:
            return Settled(None, note="stopped")
        path = interrupted.newest_finished(self.store, cid)
        if path is not None and self.store.record_at(path) is None and _stopped(pid) \
                and all(_stopped(p) for p in cgroup_pids(pid)):
            log.warning("sandbox %s: CRIU finished the dump %s after its caller died; sealing it",
                        sandbox_id, path)
            record = self._seal(info, pid, path, process_tree(pid))
            self._clear_shell(pid, also_continue=True)
            return Settled("paused", interrupted.checkpoint_of(record), note="paused")
        if _stopped(pid):  # a dump that did not finish, or did and was not sealed: the tree goes on
            _signal_all(cgroup_pids(pid), signal.SIGCONT)
        return Settled("running")

    def _settle_paused(self, pid: int, checkpoint: Checkpoint | None) -> Settled:
        dropped = checkpoint is not None and self.store.record_at(checkpoint.path) is None
        if pid and dropped:  # its resume restored it and dropped the checkpoint, then died before recording
            # it running; a tree of nothing but its init looks like a paused shell, but it has no images left
            return Settled("running", drop_checkpoint=True, note="resumed")
        if not pid or not [p for p in cgroup_pids(pid) if p != pid]:
            return Settled("paused")  # a stopped or an empty (warm) shell
        if checkpoint is not None:
            self._clear_shell(pid)  # a resume outlived its caller: the intact checkpoint stays true
            return Settled("paused", note="rolled back")
        return Settled("running", note="resumed")

    def _init_pid_or_0(self, ref: ContainerRef) -> int:
        """The container's init's host PID, 0 when the container is stopped or gone."""
        try:
            return self._init_pid(ref)
        except ContainerNotRunning:
            return 0

    @docker_errors
    def dump_in_progress(self, ref: ContainerRef) -> bool:
        pid = self._init_pid_or_0(ref)
        return bool(pid) and interrupted.dump_running(self._dump_of(pid))

    @docker_errors
    def drop_leftovers(self, ref: ContainerRef, keep: Checkpoint | None) -> list[str]:
        return interrupted.drop_leftovers(self.store, ref.container, Path(keep.path) if keep else None,
                                          self._dump_of(self._init_pid_or_0(ref)))

    # ---- disk hygiene ------------------------------------------------------------------------
    @docker_errors
    def discard_checkpoint(self, ref: ContainerRef, checkpoint: Checkpoint) -> None:
        record = self.store.record_at(checkpoint.path)
        if record is None:
            return
        with self._state_lock:
            daemons = self._serving.pop(checkpoint.path, [])

        def after() -> None:  # lazy restores still read these images until their last page is in
            for d in daemons:
                if d.wait_done(self.settings.op_timeout_s) is None:
                    log.warning("a page daemon of %s did not finish; its images are deleted anyway",
                                checkpoint.path)
        self.store.delete(record, after=after if daemons else None)

    @docker_errors
    def remove(self, ref: ContainerRef) -> None:
        with self._state_lock:
            self._warm.pop(ref.container, None)
            self._last_daemon.pop(ref.container, None)
        super().remove(ref)
        if ref.container:
            self.restore_log(ref.container).unlink(missing_ok=True)
            self._pages_marker(ref.container).unlink(missing_ok=True)
            self._cpu_baseline(ref.container).unlink(missing_ok=True)

    @docker_errors
    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "dump": "CRIU in the sandbox's namespaces: its process tree from the init; tmpfs archived",
            "restore": "into the running container (a warm shell; stopped ones are started), memory "
                       + ("lazily through CRIU's page daemon" if self.settings.lazy_pages else "eagerly")
                       + "; forks' pages KSM-mergeable" * bool(self.settings.ksm),
            "init": str(self.files.init),
            "criu_kdat_cache": str(self.files.kdat) if self.files.kdat else None,
            "warm_shells": self.settings.warm_shells,
            "ksm": ksm.describe() if self.settings.ksm else None,
        }


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def _session(pid: int) -> int | None:
    """The host PID of the session leader of process `pid` (/proc/PID/stat, field 6)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def _stopped(pid: int) -> bool:
    """Is process `pid` stopped (state T: left so by a dump)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] in "Tt"
    except (OSError, ValueError, IndexError):
        return False


def _only_the_root(archive: Path) -> bool:
    """Does the tar `archive` hold nothing but its top folder (`./`)?"""
    import tarfile

    try:
        with tarfile.open(archive) as tar:
            return [m.name for m in tar.getmembers()] in ([], ["."], ["./"])
    except (OSError, tarfile.TarError):
        return False
