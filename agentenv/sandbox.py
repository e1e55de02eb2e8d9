"""`Sandbox`: one isolated container an agent acts in, with pause (to zero memory), resume and fork.

A Sandbox object is a thin handle: its truth (state, container, checkpoints, lineage) lives in the
registry, so objects in different threads or processes (the CLI, a trainer) agree. Every state change
holds the sandbox's lock and re-reads the state under it; exec takes no lock (use one thread per sandbox).
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv import checks, files, moves, spares
from agentenv.backend.base import (
    LABEL_HOME,
    Checkpoint,
    ContainerNotRunning,
    ContainerRef,
    ContainerSpec,
    RawExec,
    ShellStream,
)
from agentenv.checks import MAX_FORKS, workspace_path
from agentenv.config import SandboxConfig
from agentenv.errors import (
    AgentEnvError,
    CheckpointError,
    ExecTimeout,
    SandboxNotFound,
    SandboxStateError,
)
from agentenv.faults import crash_point
from agentenv.locks import sandbox_lock
from agentenv.moves import MOVED, MOVING
from agentenv.registry import SandboxRecord
from agentenv.results import ExecResult, SandboxStats
from agentenv.runtime import Runtime, remove_sandbox, runtime
from agentenv.session import Session

if TYPE_CHECKING:
    from agentenv.remote import RemoteSandbox

__all__ = ["MAX_FORKS", "Sandbox", "workspace_path"]

CONTAINER_REMOVED = "its container was removed outside AgentENV"
# Labels `agentenv serve` sets on the sandboxes it serves (this key names the server, keys below it hold
# the facts of its E2B row: agentenv/server/store.py). A fork inherits its source's labels but these: a
# fork made outside the server (the CLI, a script) is not the server's; the server labels its own forks.
SERVED_LABEL = "org.k3rl.agentenv.e2b"


def _state_error(rec: SandboxRecord, action: str) -> SandboxStateError:
    sid = rec.id
    if rec.state == "paused":
        return SandboxStateError(f"sandbox {sid} is paused; resume it first (`agentenv resume {sid}`) "
                                 f"before you {action} it")
    if rec.state == "closed" and (rec.reason or "").startswith(MOVED):
        return SandboxStateError(f"sandbox {sid} {rec.reason}; reach it there (`agentenv --server "
                                 f"{rec.reason[len(MOVED):]} ...`)")
    if rec.state == "closed":
        return SandboxStateError(f"sandbox {sid} is closed; create a new one")
    if rec.state == MOVING:
        return SandboxStateError(f"sandbox {sid} is {rec.reason or 'moving to another host'}; it cannot "
                                 f"{action} until the move is settled (its destination says whether it "
                                 "arrived: retry)")
    if rec.state == "broken":
        return SandboxStateError(f"sandbox {sid} is broken: {rec.reason or 'unknown reason'}; remove it "
                                 f"(`agentenv rm {sid}`) and create a new one")
    if rec.state == "running":
        return SandboxStateError(f"sandbox {sid} is running; cannot {action} it")
    return SandboxStateError(f"sandbox {sid} is {rec.state}; cannot {action} it yet")


class Sandbox:
    """A handle on one sandbox (see module docstring). Create with `Sandbox.create`, find with `get`."""

    def __init__(self, record: SandboxRecord, rt: Runtime | None = None) -> None:
        self._rt = rt or runtime()
        self._rec = record
        self._config: SandboxConfig | None = None  # fixed at creation: parsed once per handle

    # ---- finding and creating -----------------------------------------------------------------
    @classmethod
    def create(cls, image: str | None = None, memory: str | None = None, cpus: float | None = None,
               config: SandboxConfig | None = None, labels: Mapping[str, str] | None = None) -> Sandbox:
        """Start a new sandbox; `image`/`memory`/`cpus` override `config` (conf/sandbox/default.yaml)."""
        given = checks.sandbox_labels(labels) or {}
        rt = runtime()
        cfg = (config or SandboxConfig.load()).replace(image=image, memory=memory, cpus=cpus)
        tag = rt.backend.resolve_image(cfg.image)
        user = rt.backend.probe(tag).auto_user if cfg.user == "auto" else cfg.user
        sid = secrets.token_hex(6)
        user_labels = {**cfg.labels, **given}
        rt.registry.insert_sandbox(id=sid, state="creating", image=tag, user=user, config=cfg.to_dict(),
                                   labels=user_labels)
        spec = ContainerSpec(sid, tag, user, cfg, {**user_labels, LABEL_HOME: str(rt.home)})
        try:
            ref = rt.backend.create(spec)
        except BaseException:
            rt.registry.delete_sandbox(sid)
            raise
        rt.registry.update_sandbox(sid, state="running", container=ref.container, volume=ref.volume)
        return cls.get(sid)

    @classmethod
    def get(cls, sandbox_id: str) -> Sandbox:
        """The sandbox with this id, or the only one whose id starts with it."""
        rt = runtime()
        if not isinstance(sandbox_id, str) or not sandbox_id.strip():
            raise SandboxNotFound("give a sandbox id (`agentenv ls` lists them)")
        rec = rt.registry.get_sandbox(sandbox_id)
        if rec is None:
            matches = rt.registry.find_sandboxes(sandbox_id)
            if not matches:
                raise SandboxNotFound(f"no sandbox {sandbox_id!r} in the registry at {rt.home} "
                                      "(`agentenv ls` lists them)")
            if len(matches) > 1:
                ids = ", ".join(m.id for m in matches[:5])
                raise SandboxNotFound(f"sandbox id prefix {sandbox_id!r} is ambiguous ({ids}); give more")
            rec = matches[0]
        return cls(rec, rt)

    @classmethod
    def list(cls, include_closed: bool = False) -> list[Sandbox]:
        rt = runtime()
        return [cls(r, rt) for r in rt.registry.list_sandboxes(include_closed) if r.state != spares.SPARE]

    # ---- properties ----------------------------------------------------------------------------
    def _record(self) -> SandboxRecord:
        rec = self._rt.registry.get_sandbox(self._rec.id)
        if rec is None:
            raise SandboxNotFound(f"sandbox {self._rec.id} was removed from the registry")
        self._rec = rec
        return rec

    @property
    def id(self) -> str:
        return self._rec.id

    @property
    def status(self) -> str:
        """'running' | 'paused' | 'closed' | 'broken' (read from the registry: current across processes)."""
        return self._record().state

    @property
    def reason(self) -> str | None:
        """Why the sandbox is broken (or why its last resume failed)."""
        return self._record().reason

    @property
    def image(self) -> str:
        return self._rec.image

    @property
    def user(self) -> str:
        """'agent' (uid 1000) or 'root' (uid 0 without capabilities); see `agentenv info`."""
        return self._rec.user

    @property
    def parent_id(self) -> str | None:
        return self._rec.parent_id

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._rec.labels)

    @property
    def config(self) -> SandboxConfig:
        if self._config is None:
            self._config = SandboxConfig.from_dict(self._rec.config)
        return self._config

    @property
    def container_id(self) -> str | None:
        return self._rec.container

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, status={self._rec.state!r}, image={self.image!r})"

    def describe(self) -> dict:
        """JSON-friendly summary (what `agentenv ls/create --json` print)."""
        rec = self._record()
        return {"id": rec.id, "state": rec.state, "image": rec.image, "user": rec.user,
                "parent": rec.parent_id, "created_at": rec.created_at, "reason": rec.reason,
                "labels": rec.labels, "container": (rec.container or "")[:12]}

    def _ref(self, rec: SandboxRecord) -> ContainerRef:
        return ContainerRef(container=rec.container or "", volume=rec.volume or "")

    def _lock(self, action: str):
        return sandbox_lock(self._rt.registry.lock_dir, self.id, self.config.lock_timeout_s, action)

    def _settled_record(self) -> SandboxRecord:
        """The registry row, with a move to another host that a dead process left undecided settled first
        (`agentenv.moves`: the destination says whether it arrived). The caller holds the lock."""
        rec = self._record()
        if rec.state == MOVING:
            rec = self._rec = moves.settle_locked(self._rt, rec)
        return rec

    # ---- running commands ----------------------------------------------------------------------
    def exec(self, cmd: str | Sequence[str], timeout: float | None = None, stdin: bytes | str | None = None,
             env: Mapping[str, str] | None = None, workdir: str | None = None,
             raise_on_timeout: bool = False) -> ExecResult:
        """Run `cmd` (a string runs under `sh -c`; a list runs as argv) as the sandbox user.

        At `timeout` seconds (default: config exec_timeout_s) its whole process group is killed and
        `timed_out` is set (or ExecTimeout raised with `raise_on_timeout`). stdout/stderr are capped at
        output_limit_bytes each. A non-zero exit code is a result, not an error.
        """
        argv = checks.command_argv(cmd)
        cfg = self.config
        timeout_s = checks.timeout_seconds(timeout, cfg.exec_timeout_s)
        data = checks.stdin_bytes(stdin)
        env = checks.exec_env(env)
        workdir = checks.exec_workdir(workdir)
        rec = self._record()
        if rec.state != "running":
            raise _state_error(rec, "exec in")
        raw = self._backend_exec(rec, argv, timeout_s=timeout_s, output_limit=cfg.output_limit_bytes,
                                 stdin=data, env=env, workdir=workdir)
        result = self._exec_result(raw)
        if result.timed_out and raise_on_timeout:
            raise ExecTimeout(f"command timed out after {timeout_s:g} s in sandbox {self.id}: {cmd!r}",
                              result)
        return result

    def session(self) -> Session:
        """A persistent shell in this (running) sandbox: `session.run(cmd, timeout, stdin)` has `exec`'s
        result and guarantees at a fraction of its cost (see `agentenv.session`). `pause`/`fork` end its
        shell; the next `run` starts a new one (`session.reopened`)."""
        return Session(self.id, self.config, self._open_shell, self._exec_result, self._shell_lost)

    def _open_shell(self) -> ShellStream:
        """A new session shell in this sandbox, which must be running."""
        rec = self._record()
        if rec.state != "running":
            raise _state_error(rec, "run commands in")
        try:
            return self._rt.backend.open_shell(self._ref(rec), user=rec.user)
        except ContainerNotRunning as e:
            raise self._container_lost(str(e)) from None

    def _exec_result(self, raw: RawExec) -> ExecResult:
        """The decoded result of a command run by `exec` or a session; after a command killed by a
        signal or the timeout, checks whether the OOM killer acted (then the sandbox is marked broken)."""
        oom = False
        if raw.exit_code >= 128 or raw.exit_code < 0 or raw.timed_out:
            oom = self._check_oom(self._rec)
        return raw.decoded(oom_killed=oom)

    def _backend_exec(self, rec: SandboxRecord, argv: list[str], **kw):
        try:
            return self._rt.backend.exec(self._ref(rec), argv, user=rec.user, **kw)
        except ContainerNotRunning as e:
            raise self._container_lost(str(e)) from None

    def _shell_lost(self, detail: str) -> SandboxStateError | None:
        """A session's shell ended during a command: None while the sandbox and its container still run
        (something in it ended the shell, see `Session`), else why the sandbox is no longer usable."""
        rec = self._record()
        st = self._rt.backend.state(self._ref(rec)) if rec.state == "running" else None
        if st is not None and st.running:
            return None
        return self._container_lost(detail)

    def _container_lost(self, detail: str) -> SandboxStateError:
        """The container is gone although the registry said running: record why, mark it broken."""
        with self._lock("mark broken"):
            rec = self._record()
            if rec.state != "running":
                return _state_error(rec, "exec in")
            st = self._rt.backend.state(self._ref(rec))
            if st is not None and st.running:
                return SandboxStateError(f"sandbox {self.id}: exec failed ({detail}); retry")
            if st is None:
                reason = CONTAINER_REMOVED
            else:
                reason = f"its container exited unexpectedly (exit code {st.exit_code})"
                if st.oom_killed:
                    reason += f"; the kernel OOM killer fired at the memory limit {self.config.memory}"
            self._rt.registry.update_sandbox(self.id, state="broken", reason=reason)
            return _state_error(self._record(), "exec in")

    def _check_oom(self, rec: SandboxRecord) -> bool:
        """After a killed command: did the OOM killer act in this sandbox? Then its state is unknown."""
        _rss, _cpu, _pids, oom_kills = self._rt.backend.usage(self._ref(rec))
        if oom_kills <= 0:
            return False
        reason = (f"the kernel OOM killer killed {oom_kills} process(es) at the memory limit "
                  f"{self.config.memory}; the sandbox's state is no longer trustworthy (raise `memory` if "
                  "the task needs more)")
        with self._lock("mark broken"):
            if self._record().state == "running":
                self._rt.registry.update_sandbox(self.id, state="broken", reason=reason)
        return True

    # ---- a host service on the sandbox's loopback ---------------------------------------------
    def loopback_listener(self, port: int) -> socket.socket:
        """A TCP socket listening on 127.0.0.1:`port` inside this running sandbox, held by the calling
        process: a way for the sandbox's programs to reach a service of the host although the sandbox has no
        network device. No process of the sandbox holds it, so pauses neither dump nor carry it (CRIU here
        cannot dump a socket of the internet families); a fork, and a resume that starts a new network
        namespace, need a listener of their own: compare `network_namespace()` with the one it was made in.
        The caller closes it."""
        port = checks.port_number(port)
        rec = self._record()
        if rec.state != "running":
            raise _state_error(rec, "listen in")
        try:
            return self._rt.backend.loopback_listener(self._ref(rec), port)
        except ContainerNotRunning as e:
            raise self._container_lost(str(e)) from None

    def network_namespace(self) -> int | None:
        """The id of this sandbox's network namespace while it runs (None otherwise); it changes when a
        resume or a fork gives the sandbox a new one."""
        rec = self._record()
        return self._rt.backend.network_namespace(self._ref(rec)) if rec.state == "running" else None

    # ---- files -------------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file below the work dir (parents created); paths leading out of it are refused."""
        cfg = self.config
        full = workspace_path(path, cfg.workspace)
        payload = checks.file_payload(data, cfg.file_limit_bytes)
        mode = checks.file_mode(mode)
        rec = self._record()
        if rec.state != "running":
            raise _state_error(rec, "write files in")
        argv = ["sh", "-c", files.write_script(cfg.workspace), "sh", full, format(mode, "o")]
        raw = self._backend_exec(rec, argv, timeout_s=cfg.exec_timeout_s, output_limit=64 * 1024,
                                 stdin=payload)
        self._file_error(raw, path, full, "write")

    def read_file(self, path: str) -> bytes:
        """The bytes of a file below the work dir (at most file_limit_bytes); FileNotFoundInSandbox when
        there is no such file."""
        cfg = self.config
        full = workspace_path(path, cfg.workspace)
        rec = self._record()
        if rec.state != "running":
            raise _state_error(rec, "read files from")
        script = files.read_script(cfg.workspace, cfg.file_limit_bytes)
        raw = self._backend_exec(rec, ["sh", "-c", script, "sh", full], timeout_s=cfg.exec_timeout_s,
                                 output_limit=cfg.file_limit_bytes)
        self._file_error(raw, path, full, "read")
        return raw.stdout

    def _file_error(self, raw: RawExec, path: str, full: str, verb: str) -> None:
        """Raise what a file script's outcome means (`agentenv.files.file_error`), if anything."""
        error = files.file_error(raw.exit_code, raw.stderr.decode(errors="replace"), what=f"{verb} {path!r}",
                                 path=full, sandbox_id=self.id, limit=self.config.file_limit_bytes,
                                 timed_out=raw.timed_out)
        if error is not None:
            raise error

    # ---- pause / resume / fork ----------------------------------------------------------------
    def pause(self) -> None:
        """Checkpoint every process to disk and stop the container: no process, no memory, no CPU."""
        with self._lock("pause"):
            rec = self._record()
            if rec.state == "paused":
                raise SandboxStateError(f"sandbox {self.id} is already paused")
            if rec.state != "running":
                raise _state_error(rec, "pause")
            self._pause_locked(rec)

    def _pause_locked(self, rec: SandboxRecord) -> Checkpoint:
        ref = self._ref(rec)
        if self._rt.backend.state(ref) is None:
            raise self._mark_broken(CONTAINER_REMOVED, "paused")
        self._rt.backend.end_shells(ref)  # no checkpoint may hold a shell whose stdio leads to the daemon
        _rss, cpu_now, _pids, _oom = self._rt.backend.usage(ref)
        try:
            ck = self._rt.backend.checkpoint(ref, f"ck-{secrets.token_hex(4)}", user=rec.user)
        except ContainerNotRunning as e:
            raise self._mark_broken(f"its container stopped before the checkpoint ({e})", "paused") from None
        except CheckpointError:
            st = self._rt.backend.state(ref)
            if st is None or not st.running:
                why = "its container stopped during a failed checkpoint"
                if st is not None:
                    why += f" (exit code {st.exit_code}{', OOM-killed' if st.oom_killed else ''})"
                self._rt.registry.update_sandbox(self.id, state="broken", reason=why)
            raise
        crash_point("pause-dumped")
        self._rt.registry.insert_checkpoint(self.id, ck)
        self._rt.registry.update_sandbox(self.id, state="paused", reason=None,
                                         cpu_seconds_before=rec.cpu_seconds_before + cpu_now)
        return ck

    def resume(self) -> None:
        """Restore every process from the checkpoint, verified (CheckpointError if Docker started afresh)."""
        with self._lock("resume"):
            rec = self._settled_record()
            if rec.state == "running":
                raise SandboxStateError(f"sandbox {self.id} is already running")
            if rec.state != "paused":
                raise _state_error(rec, "resume")
            self._resume_locked(rec)

    def _resume_locked(self, rec: SandboxRecord, *, keep_checkpoint: bool = False) -> None:
        """Restore from the latest checkpoint and mark running; the checkpoint is then deleted unless
        ``keep_checkpoint`` (forks still reading it: the caller deletes it)."""
        row = self._rt.registry.latest_checkpoint(self.id)
        if row is None:
            self._rt.registry.update_sandbox(self.id, state="broken", reason="paused without a checkpoint")
            raise CheckpointError(f"sandbox {self.id} is paused but has no checkpoint in the registry")
        ck = self._restorable(rec, row, "resumed")
        try:
            self._rt.backend.restore(self._ref(rec), ck, sandbox_id=self.id)
        except CheckpointError as e:
            # The checkpoint stays on disk and the sandbox stays paused: retry, fork, or remove it.
            self._rt.registry.update_sandbox(self.id, reason=f"last resume failed: {e}")
            raise CheckpointError(f"sandbox {self.id}: {e}; it stays paused (retry or remove it)") from None
        if not keep_checkpoint:
            self._drop_checkpoint(rec, ck)
        self._rt.registry.update_sandbox(self.id, state="running", reason=None)

    def _drop_checkpoint(self, rec: SandboxRecord, ck: Checkpoint) -> None:
        """Delete a checkpoint the sandbox no longer needs: its images and its registry row."""
        self._rt.backend.discard_checkpoint(self._ref(rec), ck)
        crash_point("checkpoint-discarded")
        self._rt.registry.delete_checkpoint(ck.id)

    def freeze(self) -> None:
        """Freeze every process (cgroup freezer, `docker pause`): no CPU, but the memory stays and the
        state stays ``running``; no command runs until `thaw`. Cheaper than `pause` (no checkpoint),
        for waits where memory does not matter (a pool's ``pause_method: freeze``)."""
        with self._lock("freeze"):
            rec = self._record()
            if rec.state != "running":
                raise _state_error(rec, "freeze")
            self._rt.backend.freeze(self._ref(rec))

    def thaw(self) -> None:
        """Let a frozen sandbox's processes run again (`docker unpause`)."""
        with self._lock("thaw"):
            rec = self._record()
            if rec.state != "running":
                raise _state_error(rec, "thaw")
            self._rt.backend.thaw(self._ref(rec))

    def _restorable(self, rec: SandboxRecord, ck: Checkpoint, action: str) -> Checkpoint:
        """`ck`, after checking that its files and the sandbox's container are still there. When something
        was deleted behind AgentENV's back nothing can bring the sandbox back, so it is marked broken (a
        retry would fail the same way) and CheckpointError says what to do."""
        if not Path(ck.path).exists():
            raise self._mark_broken(f"its checkpoint {ck.id} at {ck.path} is gone (deleted outside "
                                    "AgentENV)", action, CheckpointError)
        if self._rt.backend.state(self._ref(rec)) is None:
            raise self._mark_broken(CONTAINER_REMOVED, action, CheckpointError)
        return ck

    def _mark_broken(self, reason: str, action: str,
                     error: type[AgentEnvError] = SandboxStateError) -> AgentEnvError:
        """Record `reason` and state broken (the caller holds the lock); the error to raise."""
        self._rt.registry.update_sandbox(self.id, state="broken", reason=reason)
        return error(f"sandbox {self.id} cannot be {action}: {reason}; it is now marked broken: remove "
                     f"it with `agentenv rm {self.id}` and create a new one")

    def fork(self, n: int, labels: Mapping[str, str] | None = None) -> list[Sandbox]:
        """`n` new running sandboxes restored from this one's checkpoint (its memory and files). A
        running source is paused for the copy and resumed afterwards; a paused one stays paused.
        Forks share all memory, PRNG state included: reseed from /run/agentenv/seed if that matters.
        `labels`: the forks' labels (default: the source's but `SERVED_LABEL`'s)."""
        n = checks.fork_count(n)
        labels = checks.sandbox_labels(labels)
        with self._lock("fork"):
            rec = self._settled_record()
            if rec.state not in ("running", "paused"):
                raise _state_error(rec, "fork")
            was_running = rec.state == "running"
            row = self._pause_locked(rec) if was_running else self._rt.registry.latest_checkpoint(self.id)
            if row is None:
                raise CheckpointError(f"sandbox {self.id} is paused but has no checkpoint in the registry")
            if not was_running:
                return self._fork_from(self._record(), self._restorable(rec, row, "forked"), n, labels)[0]
            forks, source_error = self._fork_from(self._record(), row, n, labels, resume_source=True)
            if source_error is not None:
                ids = ", ".join(f.id for f in forks)
                raise CheckpointError(f"forks {ids} were created, but {source_error}") from None
            return forks

    def _fork_from(self, rec: SandboxRecord, ck: Checkpoint, n: int, labels: Mapping[str, str] | None = None,
                   *, resume_source: bool = False) -> tuple[list[Sandbox], BaseException | None]:
        """Restore `ck` into n new sandboxes, all or nothing: first every fork's container and copy of the
        files, then the restores, a few at a time. With `resume_source` (a running source paused for the
        fork) the source's own restore runs alongside the forks' (they all read the same page images),
        and its checkpoint is deleted once all are done; the source is brought back (or tried) also when
        the forks fail. Returns the forks and the source's resume error (None: resumed, or not asked)."""
        cfg = self.config
        fork_labels = inherited_labels(rec.labels) if labels is None else dict(labels)
        # spare shells of this template (a read-only root: nothing to copy but the work dir), then new ones
        made = spares.claim(self._rt, rec.image, rec.user, rec.config, n if cfg.read_only else 0)
        refs: dict[str, ContainerRef] = {s.id: ContainerRef(s.container or "", s.volume or "") for s in made}
        for spare in made:
            self._rt.registry.update_sandbox(spare.id, labels=fork_labels, parent_id=rec.id,
                                             parent_checkpoint=ck.id)
        ids = [s.id for s in made] + [secrets.token_hex(6) for _ in range(n - len(made))]
        for sid in ids[len(made):]:  # rows first, so that gc sees forks in progress as 'creating'
            self._rt.registry.insert_sandbox(id=sid, state="creating", image=rec.image, user=rec.user,
                                             config=rec.config, labels=fork_labels, parent_id=rec.id,
                                             parent_checkpoint=ck.id)

        def copy_files(sid: str) -> None:
            if sid in refs:  # a spare: its container runs already
                self._rt.backend.fork_into(self._ref(rec), refs[sid])
                return
            container_labels = {**fork_labels, LABEL_HOME: str(self._rt.home)}
            spec = ContainerSpec(sid, rec.image, rec.user, cfg, container_labels)
            refs[sid] = ref = self._rt.backend.fork_files(self._ref(rec), spec)
            self._rt.registry.update_sandbox(sid, container=ref.container, volume=ref.volume)

        def restore(sid: str) -> None:
            self._rt.backend.restore(refs[sid], ck, sandbox_id=sid)
            self._rt.registry.update_sandbox(sid, state="running")

        source_back = None
        with ThreadPoolExecutor(max_workers=min(n, cfg.fork_parallelism) + resume_source) as pool:
            futures = [pool.submit(copy_files, sid) for sid in ids]
            wait(futures)  # the source stays stopped until its files are copied
            copied = all(f.exception() is None for f in futures)
            if resume_source:
                source_back = pool.submit(self._resume_locked, self._record(), keep_checkpoint=True)
            if copied:
                futures = [pool.submit(restore, sid) for sid in ids]
            wait(futures + ([source_back] if source_back else []))
        source_error = source_back.exception() if source_back is not None else None
        if source_back is not None and source_error is None:
            self._drop_checkpoint(self._record(), ck)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for sid in ids:
                if sid in refs:
                    self._rt.backend.remove(refs[sid])
                self._rt.registry.delete_sandbox(sid)
            raise errors[0]
        if cfg.read_only:
            spares.replenish(self._rt, rec.image, rec.user, rec.config, n)  # for the group's next fork
        return [Sandbox.get(sid) for sid in ids], source_error

    def move(self, to: str, api_key: str | None = None, timeout: int | None = None) -> RemoteSandbox:
        """Move this paused sandbox to the `agentenv serve` host at `to` (its API key: `api_key`, else
        $AGENTENV_API_KEY), which restores it (verified; time to live `timeout` s, default its own); a handle
        on it there. Until the destination confirms, this host keeps it: a failure leaves it paused here
        (`agentenv.moves`); afterwards it is closed here (reason `moved to URL`)."""
        from agentenv.remote import RemoteSandbox, shared_host

        done = moves.move(self, to, api_key=api_key, timeout_s=timeout)
        host = shared_host(done.url, api_key)
        token = done.answer.get("envdAccessToken")
        return RemoteSandbox(host, self.id, token) if token else host.get(self.id)

    def relabel(self, labels: Mapping[str, str], remove: Iterable[str] = ()) -> None:
        """Set `labels` and drop the `remove` keys in the registry, which is what `agentenv ls`, gc and
        pools read (the container keeps the labels it was created with: Docker cannot change them)."""
        labels = checks.sandbox_labels(labels) or {}
        with self._lock("relabel"):
            rec = self._record()
            new = {k: v for k, v in rec.labels.items() if k not in set(remove)}
            new.update(labels)
            self._rt.registry.update_sandbox(self.id, labels=new)
            self._record()

    def close(self) -> None:
        """Remove the container, its volume and checkpoints (idempotent); the registry keeps the row."""
        with self._lock("close"):
            rec = self._settled_record()
            if rec.state == "closed":
                return
            if rec.state == MOVING:  # its destination may hold it by now: close it there, or retry
                raise _state_error(rec, "close")
            remove_sandbox(self._rt, rec)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> SandboxStats:
        """Memory, CPU and checkpoint size now (read from the cgroup: no process -> zeros)."""
        rec = self._record()
        rss, cpu, pids, _oom = (0, 0.0, 0, 0) if rec.state == "closed" else \
            self._rt.backend.usage(self._ref(rec))
        row = self._rt.registry.latest_checkpoint(self.id)
        return SandboxStats(id=self.id, state=rec.state, rss_bytes=rss,
                            cpu_seconds=rec.cpu_seconds_before + cpu,
                            checkpoint_bytes=row.bytes if row else 0, pids=pids,
                            memory_limit_bytes=self.config.memory_bytes, user=rec.user,
                            cpu_seconds_since_start=cpu)


def inherited_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The labels a fork takes from its source: all but `SERVED_LABEL` and the keys below it."""
    return {k: v for k, v in labels.items() if k != SERVED_LABEL and not k.startswith(SERVED_LABEL + ".")}


