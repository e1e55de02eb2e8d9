"""Kernel samepage merging for forks: the runtime owns ksmd's settings while forks share pages.

Forks restored from one checkpoint start with identical memory, but CRIU copies every page into each
child's private memory. Their restores run with PR_SET_MEMORY_MERGE (`nsexec.start_criu`), which makes
all their anonymous memory mergeable, and ksmd then folds identical pages into one copy-on-write page.
ksmd only scans processes that asked for it, so its CPU goes to forks alone; `pages_to_scan` pages every
`sleep_millisecs` bound that CPU (conf/agentenv/backend.yaml). The counters are host-wide (`describe`).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)
KSM = Path("/sys/kernel/mm/ksm")
COUNTERS = ("pages_shared", "pages_sharing", "pages_unshared", "full_scans", "general_profit")


def _write(name: str, value: int) -> None:
    path = KSM / name
    if path.read_text().strip() != str(value):
        path.write_text(str(value))


def ensure_running(settings) -> bool:
    """Start ksmd with the configured scan rate; False (logged once per reason) where the host does not
    allow it (no KSM in the kernel, or /sys read-only)."""
    try:
        _write("pages_to_scan", settings.ksm_pages_to_scan)
        _write("sleep_millisecs", settings.ksm_sleep_ms)
        _write("run", 1)
        return True
    except OSError as e:
        log.warning("KSM unavailable (%s): forks keep private copies of their pages", e)
        return False


def describe() -> dict[str, object]:
    """ksmd's state and counters (host-wide), or why there are none."""
    try:
        out: dict[str, object] = {"run": int((KSM / "run").read_text())}
        for name in ("pages_to_scan", "sleep_millisecs", *COUNTERS):
            if (KSM / name).exists():
                out[name] = int((KSM / name).read_text())
        return out
    except (OSError, ValueError) as e:
        return {"unavailable": str(e)}
