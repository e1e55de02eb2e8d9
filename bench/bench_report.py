"""What the bench scripts share: writing one benchmark's section of docs/benchmarks.md (leaving every
other section as it is), the typed training config for Hydra overrides, the line naming the machine,
the checkout's commit, and the host's busy CPU time (over an operation, or before a benchmark starts:
other jobs' load).

Each script under bench/ owns the text between its `<!-- bench:NAME:start -->` and
`<!-- bench:NAME:end -->` markers and replaces it whole on every run.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def compose(overrides: list[str]):
    """The checked, typed `RunConfig` that `python -m rl.train` builds for ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rl.train import resolve_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return resolve_config(hydra_compose("config", overrides=overrides))


def training_machine() -> str:
    """Python, torch and Ray versions, the cores, and the load average now (call it at the start)."""
    import ray
    import torch

    return (f"Python {platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}; "
            f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU; "
            f"load average {os.getloadavg()[0]:.1f} at the start")


def git_commit() -> str:
    """The checkout's commit (``+changes`` when tracked files differ from it): what a benchmark ran."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return head + ("+changes" if dirty else "")


def host_cpu_seconds() -> float:
    """CPU time the whole host has spent busy (all cores, every process, the kernel included) since boot,
    from /proc/stat (`agentenv.pool.cpu`, which the pool's cost model reads too): the difference over an
    operation on an otherwise idle machine is what it cost, including the work it caused in dockerd,
    containerd, runc and CRIU."""
    from agentenv.pool.cpu import host_cpu_seconds as read

    return read()


BUSY_WINDOW_S = 3.0    # how long the host's load is sampled before a benchmark starts
BUSY_THRESHOLD = 0.25  # cores kept busy by other processes above which a run is marked as under load


def busy_cores_before(window_s: float = BUSY_WINDOW_S) -> float:
    """Cores the host keeps busy over the next `window_s` seconds (/proc/stat, every process). Called
    before a benchmark starts anything, it is the load of other jobs *now*, which the 1-minute load
    average is not (it still counts a job that ended a minute ago)."""
    before = host_cpu_seconds()
    time.sleep(window_s)
    return (host_cpu_seconds() - before) / window_s


def other_load_text(busy: float) -> str:
    """The header's words for `busy_cores_before()`'s figure, marking a run taken under load."""
    words = f"other processes kept {busy:.2f} of the cores busy in the {BUSY_WINDOW_S:.0f} s before it " \
        "started"
    return words + (" — **taken under load**." if busy > BUSY_THRESHOLD else ".")


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
