"""No import circles inside the project's packages (scripts/import_cycles.py), and the reader itself finds
the circles it should: lazy, relative, through a package's submodule, through the parent packages Python
runs first, and none where there is none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from import_cycles import find_cycles  # noqa: E402


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_project_has_no_import_circle():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_cycles.py")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("0 import circle(s) in agentenv, rl, model, kernels")


def test_a_lazy_import_closes_a_circle(tmp_path):
    root = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def thing():\n    from pkg import a\n    return a\n",
    })
    assert find_cycles(root, ["pkg"]) == [(["pkg.a", "pkg.b"], ["pkg.a", "pkg.b", "pkg.a"])]


def test_relative_and_type_checking_imports_count_and_a_submodule_is_its_own_node(tmp_path):
    root = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from pkg.sub import inner\n",
        "pkg/sub/inner.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..top import T\n",
        "pkg/top.py": "from .sub.inner import X\n",
        "pkg/alone.py": "from pkg.sub import inner\nimport pkg.top\n",
    })
    (members, path), = find_cycles(root, ["pkg"])
    # pkg.top's import of pkg.sub.inner runs pkg/sub/__init__.py first, which imports pkg.sub.inner too
    assert members == ["pkg.sub", "pkg.sub.inner", "pkg.top"]
    assert path == ["pkg.sub", "pkg.sub.inner", "pkg.top", "pkg.sub"]


def test_a_tree_without_circles_has_none(tmp_path):
    """A package's __init__ importing its own submodules is no circle: the submodules' imports of their
    siblings run the package, which is already running (it ran before them)."""
    root = write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "import os\nfrom pkg.b import g\n",
        "pkg/b.py": "def g():\n    import json\n    return json\n",
    })
    assert find_cycles(root, ["pkg"]) == []


def test_a_circle_through_a_parent_package_that_python_runs_first_is_found(tmp_path):
    """``pkg.util`` imports only the leaf ``pkg.sub.base``, but Python runs ``pkg/sub/__init__.py`` first,
    which imports ``pkg.sub.impl``, which imports ``pkg.util``: a circle Python trips over."""
    root = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from pkg.sub.impl import run\n",
        "pkg/sub/impl.py": "from pkg.util import helper\n\ndef run():\n    return helper()\n",
        "pkg/sub/base.py": "class Base:\n    pass\n",
        "pkg/util.py": "from pkg.sub.base import Base\n\ndef helper():\n    return Base\n",
    })
    (members, path), = find_cycles(root, ["pkg"])
    assert members == ["pkg.sub", "pkg.sub.impl", "pkg.util"]
    assert path == ["pkg.sub", "pkg.sub.impl", "pkg.util", "pkg.sub"]
    ran = subprocess.run([sys.executable, "-c", "import pkg.util"], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert "partially initialized module 'pkg.util'" in ran.stderr  # Python reads it the same way

    (root / "pkg/util.py").write_text("import pkg.sub.base\n\ndef helper():\n    return pkg.sub.base.Base\n")
    assert [m for m, _ in find_cycles(root, ["pkg"])] == [members]  # `import a.b.c` runs a.b too
    # without the package's __init__ importing its submodule there is no circle: the leaf alone is fine
    (root / "pkg/sub/__init__.py").write_text("")
    assert find_cycles(root, ["pkg"]) == []
