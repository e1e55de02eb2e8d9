"""Docker's containerd, found rather than assumed: its socket, state dir and temp dir; the `ctr` calls
the fast path makes; and the one cleanup of the checkpoint copies containerd leaves behind.

Found the way dockerd itself finds it, so the fast path talks to the containerd Docker uses; the copies
containerd unpacks on every restore and never deletes are removed here (and by `agentenv gc`).

Design: docs/design/sandboxes.md#agentenv-backend-containerd.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentenv.backend.procs import pids_named

SYSTEM_SOCKET = "/run/containerd/containerd.sock"
DEFAULT_EXEC_ROOT = "/var/run/docker"
DEFAULT_DAEMON_JSON = "/etc/docker/daemon.json"
DEFAULT_STATE = "/run/containerd"
RESTORE_TOKEN_FILE = "agentenv-restore-token"


@dataclass(frozen=True)
class Containerd:
    """The containerd instance dockerd uses."""

    address: str       # its gRPC socket
    source: str        # how the address was found (for `agentenv info`)
    state_dir: Path    # task bundles: <state>/io.containerd.runtime.v2.task/<namespace>/<container>
    tmp_dir: Path      # where it unpacks checkpoints on restore

    def bundle(self, namespace: str, container_id: str) -> Path:
        return self.state_dir / "io.containerd.runtime.v2.task" / namespace / container_id


def _flag(args: Sequence[str], *names: str) -> str | None:
    """The value of the last `--name=value` / `--name value` among `args` (None when absent)."""
    value = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
    return value


def resolve_address(dockerd_args: Sequence[str], daemon_json: Mapping[str, object],
                    exists: Callable[[str], bool]) -> tuple[str, str]:
    """(socket, how it was found) from dockerd's arguments and config file, as dockerd decides it."""
    flag = _flag(dockerd_args, "--containerd")
    if flag:
        return flag, "dockerd's --containerd flag"
    if daemon_json.get("containerd"):
        return str(daemon_json["containerd"]), "`containerd` in dockerd's config file"
    if exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET, "the system containerd (dockerd uses it when its socket exists)"
    exec_root = _flag(dockerd_args, "--exec-root") or str(daemon_json.get("exec-root") or DEFAULT_EXEC_ROOT)
    return f"{exec_root.rstrip('/')}/containerd/containerd.sock", "the containerd dockerd started itself"


def _processes(comm: str) -> list[tuple[int, list[str], dict[str, str]]]:
    """(pid, argv, environment) of every process named `comm`."""
    out = []
    for pid in pids_named(comm):
        proc = Path("/proc") / str(pid)
        with contextlib.suppress(OSError):
            argv = [a for a in (proc / "cmdline").read_bytes().decode(errors="replace").split("\0") if a]
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in kv)
            out.append((pid, argv, env))
    return out


def _daemon_json(dockerd_args: Sequence[str]) -> dict[str, object]:
    path = Path(_flag(dockerd_args, "--config-file") or DEFAULT_DAEMON_JSON)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def serving(argv: Sequence[str], config: Mapping[str, object]) -> tuple[str, str]:
    """(socket, state dir) of a containerd process from its arguments and its parsed config file."""
    grpc = config.get("grpc") if isinstance(config.get("grpc"), dict) else {}
    address = _flag(argv, "--address", "-a") or str(grpc.get("address") or SYSTEM_SOCKET)
    state = _flag(argv, "--state") or str(config.get("state") or DEFAULT_STATE)
    return address, state


def find_containerd(configured: str = "auto") -> Containerd:
    """The containerd dockerd uses; `configured` (a socket path) skips the search for the address."""
    dockerds = _processes("dockerd")
    args = dockerds[0][1] if dockerds else []
    if configured != "auto":
        address, source = configured, "containerd_address in conf/agentenv/backend.yaml"
    elif not dockerds:
        address, source = resolve_address([], {}, lambda p: Path(p).exists())
        source += "; no dockerd process is visible, so its flags could not be read"
    else:
        address, source = resolve_address(args, _daemon_json(args), lambda p: Path(p).exists())
    state, tmp = Path(DEFAULT_STATE), Path("/tmp")
    for _pid, argv, env in _processes("containerd"):
        config: dict[str, object] = {}
        cfg_file = _flag(argv, "--config", "-c")
        if cfg_file:
            with contextlib.suppress(OSError, tomllib.TOMLDecodeError):
                config = tomllib.loads(Path(cfg_file).read_text())
        sock, state_dir = serving(argv, config)
        if Path(sock).resolve() == Path(address).resolve():
            state, tmp = Path(state_dir), Path(env.get("TMPDIR") or "/tmp")
            break
    return Containerd(address=address, source=source, state_dir=state, tmp_dir=tmp)


def tmp_dirs() -> list[Path]:
    """Where the running containerd processes unpack checkpoints ($TMPDIR of each, default /tmp)."""
    dirs = {Path(env.get("TMPDIR") or "/tmp") for _pid, _argv, env in _processes("containerd")}
    return sorted(dirs) or [Path("/tmp")]


def remove_restore_copies(token: str | None = None, older_than_s: float | None = None,
                          dry_run: bool = False) -> list[str]:
    """Delete containerd's unpacked copies of our restores (see the module docstring): with `token`,
    the copy of that restore; with `older_than_s`, every copy whose token is at least that old."""
    removed = []
    now = time.time()
    for tmp in tmp_dirs():
        for marker in tmp.glob(f"ctrd-checkpoint*/{RESTORE_TOKEN_FILE}"):
            try:
                if token is not None and marker.read_text().strip() != token:
                    continue
                if older_than_s is not None and now - marker.stat().st_mtime < older_than_s:
                    continue
            except OSError:
                continue
            if not dry_run:
                shutil.rmtree(marker.parent, ignore_errors=True)
            removed.append(str(marker.parent))
    return removed
