#!/usr/bin/env python3
"""Find import circles inside the project's packages, reading the imports with `ast` (nothing is run).

Every import counts (lazy and ``TYPE_CHECKING`` ones too, and the packages Python runs first).
Usage: python scripts/import_cycles.py [PACKAGE ...]; exit 1 on any circle.

Design: docs/design/tooling.md#scripts-import-cycles.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PACKAGES = ("agentenv", "rl", "model", "kernels")


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given top-level packages."""
    out: dict[str, Path] = {}
    for package in packages:
        base = root / package
        if not (base / "__init__.py").is_file():
            raise SystemExit(f"import_cycles: {base} is not a package (no __init__.py)")
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def absolute_module(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module named by a (possibly relative) ``from`` import in ``module``."""
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that ``module`` imports anywhere in its file, with the packages each import
    runs first (see the module docstring)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = absolute_module(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    running = packages_of(module) | {module}  # a package's __init__ runs before its submodules too
    first = {package for m in found for package in packages_of(m)} - running
    return {m for m in found | first if m in known and m != module} | ({module} if module in found else set())


def packages_of(module: str) -> set[str]:
    """The packages Python runs before ``module`` itself: ``a`` and ``a.b`` for ``a.b.c``."""
    parts = module.split(".")
    return {".".join(parts[:n]) for n in range(1, len(parts))}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only circles are returned."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1 or node in graph[node]:
                    circles.append(sorted(group))
    return circles


def path_around(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circular path through the group's first module (breadth-first, inside the group)."""
    start, members = group[0], set(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start, start]


def find_cycles(root: Path, packages: Iterable[str]) -> list[tuple[list[str], list[str]]]:
    """Each import circle among the modules of ``packages`` under ``root``: (its modules, a path around
    it through the first of them)."""
    files = module_files(root, packages)
    known = set(files)
    graph = {m: imports_of(m, p, known) for m, p in files.items()}
    return [(group, path_around(group, graph)) for group in strongly_connected(graph)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", default=list(DEFAULT_PACKAGES),
                        help=f"top-level packages to read (default: {' '.join(DEFAULT_PACKAGES)})")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    args = parser.parse_args(argv)
    cycles = find_cycles(args.root, args.packages)
    for members, path in cycles:
        print(f"circle of {len(members)} module(s): {' -> '.join(path)}")
        if len(members) > len(set(path)):
            print(f"  all of them: {', '.join(members)}")
    print(f"{len(cycles)} import circle(s) in {', '.join(args.packages)}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
