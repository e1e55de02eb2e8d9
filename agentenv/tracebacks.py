"""An exception of a task's own code, told with the frames of the files its author wrote.

A task runs under layers of platform code, so the full traceback is mostly frames nobody needs;
`task_frames` keeps the task's own and `describe` prints them in Python's format, so an editor can jump
to the line.

Design: docs/design/sandboxes.md#agentenv-tracebacks.
"""

from __future__ import annotations

import sysconfig
import traceback
from functools import cache
from pathlib import Path

PLATFORM_PACKAGES = ("agentenv", "rl", "model", "kernels")
_ROOT = Path(__file__).resolve().parents[1]  # the folder that holds the platform packages
_TASKS = _ROOT / "agentenv" / "tasks"


@cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    dirs |= {str(_ROOT / p) for p in PLATFORM_PACKAGES}
    return tuple(sorted(str(Path(d).resolve()) + "/" for d in dirs))


def is_task_file(filename: str) -> bool:
    """Whether ``filename`` is a task's code rather than the platform's or a library's."""
    if filename.startswith("<"):  # <frozen ...>, <string>: not a file anyone edits
        return False
    path = Path(filename).resolve()
    if path.parent == _TASKS and path.name != "base.py":
        return True
    return not str(path).startswith(_library_dirs())


def task_frames(exc: BaseException, limit: int = 6) -> list[traceback.FrameSummary]:
    """The last ``limit`` frames of ``exc``'s traceback that lie in task files (`is_task_file`)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return [f for f in frames if is_task_file(f.filename)][-limit:]


def frames_text(exc: BaseException, limit: int = 6, fallback: int = 0) -> str | None:
    """The task-file frames of ``exc`` in Python's traceback format (a file below the working directory
    named relative to it); without any, its last ``fallback`` frames wherever they are (0: None)."""
    frames = task_frames(exc, limit)
    if not frames and fallback:
        frames = traceback.extract_tb(exc.__traceback__)[-fallback:]
    if not frames:
        return None
    return "".join(traceback.format_list([_relative(f) for f in frames])).rstrip()


def _relative(frame: traceback.FrameSummary) -> traceback.FrameSummary:
    """``frame`` named relative to the working directory when below it (not when that is ``/``), without
    its column range (the same lines wherever it is printed)."""
    name = frame.filename
    try:
        cwd = Path.cwd().resolve()
        if cwd != Path(cwd.anchor):
            name = str(Path(frame.filename).resolve().relative_to(cwd))
    except (ValueError, OSError):
        pass
    return traceback.FrameSummary(name, frame.lineno, frame.name, line=frame.line)


def describe(exc: BaseException, limit: int = 6, fallback: int = 0) -> str:
    """``Type: message`` and, below it, the frames of `frames_text` (none: the line alone)."""
    line = f"{type(exc).__name__}: {exc}".rstrip()
    frames = frames_text(exc, limit, fallback)
    return f"{line}\n{frames}" if frames else line
