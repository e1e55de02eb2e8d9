#!/usr/bin/env python3
"""Check the backend seam: only `agentenv.backend` talks to Docker, containerd and CRIU, reading every
module's imports with `ast` (nothing is run).

Every import counts, lazy and ``TYPE_CHECKING`` ones too, and the package must be a layer (no import
circle through it). Usage: python scripts/backend_seam.py [FOLDER ...]; exit 1 on a breach.

Design: docs/design/tooling.md#scripts-backend-seam.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_cycles import absolute_module, imports_of, module_files, strongly_connected  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FOLDERS = ("agentenv", "rl", "model", "kernels", "scripts")
BACKEND = "agentenv.backend"
ENGINE_SDKS = ("docker",)  # client libraries of the engines
# What may be imported from the backend package outside it: the seam (`base`) and helpers that talk to no
# engine: errors, command timeouts, cgroup readers, the checkpoint store's records and the move stream's
# format, and the image builder behind `agentenv images`.
PUBLIC = frozenset(f"{BACKEND}{suffix}" for suffix in (
    "", ".base", ".errors", ".commands", ".cgroups", ".store", ".transfer", ".images"))
# Modules of the backend package that one module outside it may import: the selector, for the runtime.
ONLY_FOR = {f"{BACKEND}.selection": frozenset({"agentenv.runtime"})}


def python_files(root: Path, folders: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file for every .py file under the folders: a package's modules by their
    dotted names, a folder of loose scripts (no __init__.py) by their file names."""
    out: dict[str, Path] = {}
    for folder in folders:
        base = root / folder
        if not base.is_dir():
            raise SystemExit(f"backend_seam: {base} is no folder")
        package = (base / "__init__.py").is_file()
        for path in sorted(base.rglob("*.py") if package else base.glob("*.py")):
            parts = list(path.relative_to(root if package else base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything ``module`` imports: ``from a import b`` names ``a.b`` (a module or
    a name in ``a``: both are checked as ``a.b``, and ``a`` itself is the package run first)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            target = absolute_module(module, is_package, node.level, node.module)
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}" if target == BACKEND else target


def breach(module: str, name: str) -> str | None:
    """Why ``module`` (outside the backend) may not import ``name``; None when it may."""
    if any(name == sdk or name.startswith(sdk + ".") for sdk in ENGINE_SDKS):
        return f"an engine's SDK, which only {BACKEND} uses"
    if name != BACKEND and not name.startswith(BACKEND + "."):
        return None
    if name in PUBLIC or module in ONLY_FOR.get(name, ()):
        return None
    only = f" (it is for {', '.join(sorted(ONLY_FOR[name]))} only)" if name in ONLY_FOR else ""
    return f"behind the seam{only}: use {BACKEND}.base and the backend agentenv.runtime.runtime() gives"


def breaches(root: Path, folders: Iterable[str]) -> list[str]:
    """'path:line: module imports ...' for every import across the seam in the folders' modules."""
    out = []
    for module, path in python_files(root, folders).items():
        if module == BACKEND or module.startswith(BACKEND + "."):
            continue
        for line, name in imported(module, path):
            why = breach(module, name)
            if why is not None:
                out.append(f"{path.relative_to(root)}:{line}: {module} imports {name}: {why}")
    return out


def loops(root: Path) -> list[list[str]]:
    """The import circles through the backend package, its modules taken as one node ``agentenv.backend``:
    each the modules in it (sorted); [] when the package is a layer."""
    files = module_files(root, ["agentenv"])
    known = set(files)

    def node(module: str) -> str:
        return BACKEND if module == BACKEND or module.startswith(BACKEND + ".") else module

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        graph.setdefault(node(module), set()).update(node(m) for m in imports_of(module, path, known))
    for name, edges in graph.items():
        edges.discard(name)  # the package's own imports of its modules
    return [group for group in strongly_connected(graph) if BACKEND in group]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", default=list(DEFAULT_FOLDERS),
                        help=f"folders to read (default: {' '.join(DEFAULT_FOLDERS)})")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    args = parser.parse_args(argv)
    found = breaches(args.root, args.folders)
    for line in found:
        print(line)
    circles = loops(args.root) if "agentenv" in args.folders else []
    for group in circles:
        print(f"{BACKEND} and modules outside it import each other: {', '.join(group)}")
    print(f"{len(found)} import(s) across the backend seam in {', '.join(args.folders)}; "
          f"{len(circles)} circle(s) through it")
    return 1 if found or circles else 0


if __name__ == "__main__":
    sys.exit(main())
