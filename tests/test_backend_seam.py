"""Only `agentenv.backend` talks to Docker, containerd and CRIU (scripts/backend_seam.py): the project has no
import across the seam and no circle through the backend package, and the reader finds each kind of
crossing (lazy, relative, under TYPE_CHECKING, the SDK, a name of the package) and none where there is none.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from backend_seam import breaches, loops  # noqa: E402


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_project_reaches_the_engine_only_through_the_backend():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "backend_seam.py")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines() == ["0 import(s) across the backend seam in agentenv, rl, model, "
                                                "kernels, scripts; 0 circle(s) through it"]


BACKEND = {
    "agentenv/__init__.py": "",
    "agentenv/backend/__init__.py": "",
    "agentenv/backend/base.py": "class SandboxBackend:\n    pass\n",
    "agentenv/backend/docker_client.py": "import docker\n",
    "agentenv/backend/containers.py": "import docker.errors\nfrom agentenv.backend import docker_client\n",
    "agentenv/backend/selection.py": "from agentenv.backend.containers import docker\n",
    "agentenv/runtime.py": "from agentenv.backend.selection import docker\n",
}


def test_every_kind_of_crossing_is_found_with_its_line(tmp_path):
    root = write(tmp_path, {**BACKEND,
        "agentenv/server/__init__.py": "",
        "agentenv/server/procs.py": (
            "from typing import TYPE_CHECKING\n"
            "from agentenv.backend.base import SandboxBackend\n"      # the seam's types: fine
            "from agentenv.backend import base\n"                    # the same, by name: fine
            "if TYPE_CHECKING:\n"
            "    import docker.errors\n"                             # the SDK, for types only
            "def root():\n"
            "    from agentenv.backend import docker_client\n"       # lazy, a name of the package
            "    from ..backend.containers import docker\n"          # relative
            "    return docker_client\n"),
        "agentenv/gc.py": "import agentenv.backend.selection\n",    # the selector is the runtime's
        "scripts/tool.py": "from docker import APIClient\n",
    })
    use = "use agentenv.backend.base and the backend agentenv.runtime.runtime() gives"
    sdk = "an engine's SDK, which only agentenv.backend uses"
    assert breaches(root, ["agentenv", "scripts"]) == [
        f"agentenv/gc.py:1: agentenv.gc imports agentenv.backend.selection: behind the seam (it is for "
        f"agentenv.runtime only): {use}",
        f"agentenv/server/procs.py:5: agentenv.server.procs imports docker.errors: {sdk}",
        f"agentenv/server/procs.py:7: agentenv.server.procs imports agentenv.backend.docker_client: behind "
        f"the seam: {use}",
        f"agentenv/server/procs.py:8: agentenv.server.procs imports agentenv.backend.containers: behind the "
        f"seam: {use}",
        f"scripts/tool.py:1: tool imports docker: {sdk}",
    ]
    assert loops(root) == []


def test_the_backend_and_the_runtime_alone_have_no_crossing(tmp_path):
    root = write(tmp_path, BACKEND)
    assert breaches(root, ["agentenv"]) == []


def test_a_module_outside_the_backend_that_the_backend_imports_back_is_a_circle(tmp_path):
    """The image builder outside the package, importing its Docker client, while a backend module imports
    the builder inside a function: no circle of modules, but one through the package (what
    agentenv/images.py was)."""
    root = write(tmp_path, {**BACKEND,
        "agentenv/images.py": "from agentenv.backend import docker_client\n",
        "agentenv/backend/containers.py": "def resolve():\n    from agentenv import images\n",
    })
    assert loops(root) == [["agentenv.backend", "agentenv.images"]]
    (root / "agentenv/images.py").unlink()
    write(root, {"agentenv/backend/images.py": "from agentenv.backend import docker_client\n",
                 "agentenv/backend/containers.py": "from agentenv.backend import images\n"})
    assert loops(root) == []
