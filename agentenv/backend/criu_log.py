"""The one reader of CRIU's logs: the error lines of a failed dump or restore, whether a restore log
shows a finished restore (Docker has reported fresh starts as restores: docker/for-linux #1192), and
how long that restore took CRIU itself."""

from __future__ import annotations

import re
from pathlib import Path

RESTORE_OK = "Restore finished successfully"


def error_lines(path: Path, limit: int = 3, skip: tuple[str, ...] = ()) -> list[str]:
    """Up to `limit` error lines of the CRIU log at `path`, in log order: the first (the cause: what
    follows it is CRIU unwinding, e.g. ``cgroupd: recv req error`` after a failed restore) and the last
    ones. Lines holding any of `skip` are left out; empty when the log cannot be read."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    errors = [ln.split(": ", 1)[-1].strip() for ln in lines if "Error" in ln or "error" in ln]
    errors = [e for e in errors if not any(s in e for s in skip)]
    if len(errors) <= limit or limit < 1:
        return errors[:max(limit, 0)]
    return [errors[0], *errors[len(errors) - limit + 1:]]


def explain(path: Path | None, limit: int = 3, skip: tuple[str, ...] = ()) -> str:
    """'; CRIU says: a | b' from the log at `path` (`error_lines`), or '' (to append to an error message)."""
    errors = error_lines(path, limit, skip) if path is not None else []
    return "; CRIU says: " + " | ".join(errors) if errors else ""


def log_named_in(message: str) -> Path | None:
    """The CRIU log a Docker/containerd/runc error message points at (`path=...log`, `log file: ...log`)."""
    m = re.search(r"(?:path=|log file:)\s*(\S+\.log)", message)
    return Path(m.group(1)) if m else None


def restore_finished(path: Path, since: float) -> bool:
    """Does the restore log at `path`, written at or after `since` (epoch seconds), report success?"""
    try:
        return path.stat().st_mtime >= since - 1.0 and RESTORE_OK in path.read_text(errors="replace")[-4096:]
    except OSError:
        return False


def restore_seconds(path: Path) -> float | None:
    """Seconds CRIU spent on the last restore logged at `path`: the timestamp (relative to CRIU's start)
    of its last "Restore finished successfully" line; None when the log has none or cannot be read."""
    try:
        tail = Path(path).read_text(errors="replace")[-65536:]
    except OSError:
        return None
    found = re.findall(r"^\((\d+\.\d+)\) " + RESTORE_OK, tail, flags=re.MULTILINE)
    return float(found[-1]) if found else None
