"""The two ways a running container's processes get dumped into the checkpoint store.

`ContainerdDump` (`fastpath`: containerd's checkpoint RPC, no content-store copies) and `DockerApiDump`
(`docker-criu`, the fallback: Docker's checkpoint API, which works wherever `dockerd --experimental` runs).
Both leave the container stopped or raise CheckpointError; dumps through Docker run one at a time.

Design: docs/design/sandboxes.md#agentenv-backend-dumpers.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import docker

from agentenv.backend import criu_log
from agentenv.backend.host import HostSupport
from agentenv.backend.settings import BackendSettings
from agentenv.errors import CheckpointError
from agentenv.locks import file_lock

log = logging.getLogger(__name__)

# CRIU (or runc, freezing the cgroup first) could not freeze every task in time (e.g. one in
# uninterruptible sleep): the tasks were thawed, and a new attempt usually succeeds (seen on a heavily
# loaded host).
TRANSIENT_DUMP_ERRORS = ("Timeout reached", "Unseizable non-zombie", "unable to freeze")


class ContainerdDump:
    """`ctr tasks checkpoint --exit --image-path PATH --work-path WORK CONTAINER`."""

    def __init__(self, settings: BackendSettings, host: HostSupport) -> None:
        assert host.ctr_path is not None and host.containerd is not None
        self.settings, self.host = settings, host

    def dump(self, api: docker.APIClient, container: str, path: Path, work: Path) -> None:
        r = ctr(self.settings, self.host, "tasks", "checkpoint", "--exit", "--image-path", str(path),
                "--work-path", str(work), container)
        if r.returncode != 0:
            raise CheckpointError(f"CRIU could not checkpoint container {container[:12]}: "
                                  f"{r.stderr.strip()[-300:]}{criu_log.explain(work / 'dump.log')}")


def ctr(settings: BackendSettings, host: HostSupport, *args: str) -> subprocess.CompletedProcess[str]:
    """containerd's CLI on Docker's containerd, in Docker's namespace."""
    cmd = [str(host.ctr_path), "--address", host.containerd.address,  # type: ignore[union-attr]
           "--namespace", settings.containerd_namespace, *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=settings.op_timeout_s)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"`{' '.join(cmd)}` ran past {settings.op_timeout_s:.0f} s") from None


class DockerApiDump:
    """`POST /containers/{id}/checkpoints {CheckpointID, CheckpointDir, Exit: true}`, one at a time on the
    host, after containerd collected the previous one's blobs (see the module docstring)."""

    def __init__(self, settings: BackendSettings, host: HostSupport) -> None:
        self.settings, self.host = settings, host

    def _collect_previous_checkpoint(self) -> None:
        """Run containerd's garbage collector now: create a lease and delete it with ``--sync``."""
        if self.host.ctr_path is None or self.host.containerd is None:
            return  # containerd unreachable: its collector runs on its own schedule
        made = ctr(self.settings, self.host, "leases", "create")
        lease = made.stdout.split()[0] if made.returncode == 0 and made.stdout.split() else ""
        failed = made if not lease else ctr(self.settings, self.host, "leases", "delete", "--sync", lease)
        if failed.returncode or not lease:
            log.warning("could not run containerd's garbage collector before a checkpoint (`ctr %s`): %s",
                        " ".join(failed.args[5:]), (failed.stderr or "no lease id").strip()[-200:])

    def dump(self, api: docker.APIClient, container: str, path: Path, work: Path) -> None:
        with file_lock(self.settings.store_dir / ".docker-checkpoint.lock"):  # one at a time
            self._collect_previous_checkpoint()
            self._post_checkpoint(api, container, path)

    def _post_checkpoint(self, api: docker.APIClient, container: str, path: Path) -> None:
        path.rmdir()  # Docker creates <CheckpointDir>/<CheckpointID> itself and refuses an existing one
        try:
            res = api._post_json(api._url("/containers/{0}/checkpoints", container),
                                 data={"CheckpointID": path.name, "CheckpointDir": str(path.parent),
                                       "Exit": True})
            api._raise_for_status(res)
        except docker.errors.APIError as e:
            message = str(e.explanation or e)
            why = criu_log.explain(criu_log.log_named_in(message)) or f": {message.strip().splitlines()[0]}"
            raise CheckpointError(f"CRIU could not checkpoint container {container[:12]}{why}") from None
        finally:
            path.mkdir(exist_ok=True)
