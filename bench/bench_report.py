"""Writes one benchmark's section of docs/benchmarks.md, leaving every other section as it is.

Each script under bench/ owns the text between its `<!-- bench:NAME:start -->` and
`<!-- bench:NAME:end -->` markers and replaces it whole on every run.
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the ``bench:name`` section of ``path`` with ``body``; exit with a clear message if the
    file lacks that section's markers."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    text = path.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{path} lacks the markers {start} / {end}; add them where the section belongs")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body.strip()}\n{end}{tail}")
    print(f"wrote the {name!r} section of {path}")
