"""The container runtime behind one seam (`SandboxBackend`, implemented by `runtime.CriuRuntime`).

Two backends, named in conf/agentenv/backend.yaml (`backend`, or `$AGENTENV_BACKEND`), share everything
but the dump: `fastpath` (containerd's checkpoint RPC) and `docker-criu` (Docker's checkpoint API). When
the configured one cannot run on this host, `selection.select_backend` raises BackendUnavailable with the
reason, unless `fallback: docker-criu` is configured; the backend says which it is and why (`agentenv info`).

Only this package talks to Docker, containerd and CRIU (scripts/backend_seam.py checks it): the rest of
AgentENV uses the seam's types (`base`), the backend object `agentenv.runtime.runtime()` selects, and the
engine-neutral helpers `backend_seam.PUBLIC` names.

This file imports no module of its own: Python runs it before any module of the package (`docker_client`,
`base`, `cgroups`), so importing it would load the Docker SDK in every process that reads a cgroup.
"""

