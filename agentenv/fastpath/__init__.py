"""AgentENV fast path: pause / resume / fork through containerd + CRIU, several times faster than
Docker's own checkpoint path, with Docker still knowing every container's state (see engine.py).

    from agentenv.fastpath import FastPath
    fp = FastPath()                       # settings from conf/agentenv/fastpath.yaml
    rec = fp.pause(container_id)          # CRIU images on local disk; the container holds no memory
    fp.resume(container_id)               # Docker restores it; `docker exec` works again
    ids = fp.fork(container_id, 8)        # 8 new containers with the same memory and files
"""

from agentenv.fastpath.engine import FastPath, GcReport
from agentenv.fastpath.errors import DiskCapExceeded, FastPathUnavailable, RestoreNotVerified
from agentenv.fastpath.host import HostSupport, probe
from agentenv.fastpath.settings import FastPathSettings
from agentenv.fastpath.store import CheckpointRecord, CheckpointStore

__all__ = [
    "CheckpointRecord",
    "CheckpointStore",
    "DiskCapExceeded",
    "FastPath",
    "FastPathSettings",
    "FastPathUnavailable",
    "GcReport",
    "HostSupport",
    "RestoreNotVerified",
    "probe",
]
