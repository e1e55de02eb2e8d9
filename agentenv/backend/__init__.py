"""The container runtime behind one seam (`SandboxBackend`, implemented by `runtime.CriuRuntime`).

Only this package talks to Docker, containerd and CRIU (scripts/backend_seam.py checks it), so a backend can
change without touching the rest of AgentENV. This file imports nothing of its own: it runs before every
module of the package, and importing here would load the Docker SDK wherever a cgroup is read.

Design: docs/design/sandboxes.md#agentenv-backend.
"""

