"""The two ways a running container's processes get dumped into the checkpoint store.

Both leave the container stopped (no process, no memory) and the CRIU images in the store folder given,
or raise CheckpointError with CRIU's error lines (the container keeps running); they differ only in who
asks runc to checkpoint:

* `ContainerdDump` (the `fastpath` backend): containerd's own checkpoint RPC with an image path
  (`ctr tasks checkpoint --exit --image-path`), the call Docker makes minus its content store: no tar,
  no SHA-256, no second and third copy. dockerd processes the task's exit event as after
  `docker checkpoint create`: the container is `exited`.
* `DockerApiDump` (the `docker-criu` backend, the fallback): Docker's experimental checkpoint API
  (`POST /containers/{id}/checkpoints` with a checkpoint dir in the store), which works wherever
  `dockerd --experimental` runs, at Docker's cost (moby #40644).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import docker

from agentenv.backend import criu_log
from agentenv.backend.host import HostSupport
from agentenv.backend.settings import BackendSettings
from agentenv.errors import CheckpointError

# CRIU could not freeze every task in time (e.g. one in uninterruptible sleep): it resumed them all, and
# a new attempt usually succeeds (seen on a heavily loaded host).
TRANSIENT_DUMP_ERRORS = ("Timeout reached", "Unseizable non-zombie")


class ContainerdDump:
    """`ctr tasks checkpoint --exit --image-path PATH --work-path WORK CONTAINER`."""

    def __init__(self, settings: BackendSettings, host: HostSupport) -> None:
        assert host.ctr_path is not None and host.containerd is not None
        self.settings, self.host = settings, host

    def ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.host.ctr_path), "--address", self.host.containerd.address,  # type: ignore[union-attr]
               "--namespace", self.settings.containerd_namespace, *args]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=self.settings.op_timeout_s)
        except subprocess.TimeoutExpired:
            raise CheckpointError(f"`{' '.join(cmd)}` ran past {self.settings.op_timeout_s:.0f} s") from None

    def dump(self, api: docker.APIClient, container: str, path: Path, work: Path) -> None:
        r = self.ctr("tasks", "checkpoint", "--exit", "--image-path", str(path), "--work-path", str(work),
                     container)
        if r.returncode != 0:
            raise CheckpointError(f"CRIU could not checkpoint container {container[:12]}: "
                                  f"{r.stderr.strip()[-300:]}{criu_log.explain(work / 'dump.log')}")


class DockerApiDump:
    """`POST /containers/{id}/checkpoints {CheckpointID, CheckpointDir, Exit: true}`."""

    def dump(self, api: docker.APIClient, container: str, path: Path, work: Path) -> None:
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
