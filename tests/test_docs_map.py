"""docs/map.md stays true: every row names exactly one module, and that module exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (?P<concern>[^|]+?) \| (?P<where>[^|]+?) \|$")


def _rows() -> list[tuple[str, str]]:
    rows = []
    for line in (ROOT / "docs" / "map.md").read_text().splitlines():
        m = ROW.match(line)
        if m and m["concern"] not in ("To change …", "---"):
            rows.append((m["concern"], m["where"]))
    return rows


def test_the_map_has_rows_for_the_questions_a_new_engineer_asks():
    concerns = [c for c, _ in _rows()]
    assert len(concerns) >= 20
    assert any("pause" in c and "budget" in c for c in concerns)
    assert any("generation engine" in c for c in concerns)


def test_each_row_names_one_existing_module():
    for concern, where in _rows():
        paths = re.findall(r"`([^`]+)`", where)
        assert len(paths) == 1, f"row {concern!r} must name exactly one module, names {paths}"
        assert (ROOT / paths[0]).is_file(), f"docs/map.md: {paths[0]} (for {concern!r}) does not exist"
