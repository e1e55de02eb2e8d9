"""Several AgentENV backends side by side in one benchmark process: a `Variant` is a backend with some
of its settings changed (the warm backend, fastpath, warm without lazy pages ...), and `Backends` gives
each variant its own registry and backend config file, switching $AGENTENV_HOME, $AGENTENV_BACKEND and
$AGENTENV_BACKEND_CONFIG (the public ways to pick a backend) around the calls that create sandboxes.
Also the two warm-backend calls a benchmark needs on a sandbox: the wait for its last page, and
stopping (cooling) its paused shell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Variant:
    """A backend with some of its settings changed (`settings`: keys of conf/agentenv/backend.yaml), run
    in a registry of its own. `kdat` False: warm shells without CRIU's kernel-facts cache (no public
    setting turns it off; CRIU then recomputes the facts on every run)."""

    key: str
    backend: str
    label: str
    settings: Mapping[str, object] = field(default_factory=dict)
    kdat: bool = True


WARM = Variant("warm", "warm", "warm shells (the default backend)")
# spare shells are started containers: only the warm backend restores into one (fastpath forks fail there)
FASTPATH = Variant("fastpath", "fastpath", "fastpath (containerd's dump, Docker's `start --checkpoint`)",
                   {"spare_shells": False})
WARM_NO_SPARES = Variant("warm-no-spares", "warm", "warm shells, no spare shells", {"spare_shells": False})
ENV_KEYS = ("AGENTENV_HOME", "AGENTENV_BACKEND", "AGENTENV_BACKEND_CONFIG")


class Backends:
    """Runtimes of several backends in one process. Each variant gets its own $AGENTENV_HOME under
    `root` and its own backend config file (the configured one with the variant's settings changed);
    `use` sets $AGENTENV_HOME, $AGENTENV_BACKEND and $AGENTENV_BACKEND_CONFIG for a block, where every
    Sandbox call picks the variant's runtime: run each variant's sandboxes inside its block (a handle
    keeps its runtime, but `fork` finds its new handles through $AGENTENV_HOME)."""

    def __init__(self, root: Path) -> None:
        from agentenv.backend.settings import default_settings_path

        self.root = root
        self.base_config = default_settings_path()
        self.used: dict[str, Variant] = {}

    def _config_file(self, v: Variant) -> Path:
        import yaml

        path = self.root / f"{v.key}.backend.yaml"
        if not path.exists():
            data = yaml.safe_load(self.base_config.read_text()) or {}
            unknown = sorted(set(v.settings) - set(data))
            if unknown:
                raise SystemExit(f"variant {v.key}: {unknown} are not keys of {self.base_config}")
            data.update(v.settings, backend=v.backend)
            path.write_text(yaml.safe_dump(data))
        return path

    @contextlib.contextmanager
    def use(self, v: Variant) -> Iterator:
        from agentenv.errors import BackendUnavailable
        from agentenv.sandbox import runtime

        home = self.root / v.key
        home.mkdir(parents=True, exist_ok=True)
        saved = {k: os.environ.get(k) for k in ENV_KEYS}
        os.environ.update(AGENTENV_HOME=str(home), AGENTENV_BACKEND=v.backend,
                          AGENTENV_BACKEND_CONFIG=str(self._config_file(v)))
        try:
            try:
                rt = runtime()
            except BackendUnavailable as e:
                raise SystemExit(f"the benchmark's {v.label} cannot run here: {e}") from None
            if rt.backend.name != v.backend:
                raise SystemExit(f"the benchmark's {v.label} got backend {rt.backend.name!r} instead "
                                 f"({rt.backend.reason})")
            files = getattr(rt.backend, "files", None)
            if not v.kdat and files is not None and files.kdat is not None:
                rt.backend.files = dataclasses.replace(files, kdat=None)
            self.used[v.key] = v
            yield rt
        finally:
            for k, val in saved.items():
                if val is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = val

    def close_all(self) -> None:
        """Close every sandbox and spare shell of every variant used (their registries are this run's)."""
        from agentenv import Sandbox, spares

        for v in list(self.used.values()):
            with self.use(v) as rt:
                for sb in Sandbox.list():
                    try:
                        sb.close()
                    except Exception as e:  # noqa: BLE001 - report and go on cleaning
                        print(f"cleanup: {sb.id}: {e}", file=sys.stderr)
                if rt.registry.lock_dir.exists():  # (a registry that never held a sandbox has none)
                    spares.expire(rt, 0.0)


def page_fill(sb) -> float | None:
    """Wait until the sandbox's last restore has every page (warm backend, lazy pages): seconds from the
    page daemon's start; None for a restore without a page daemon."""
    fill = getattr(sb._rt.backend, "page_fill_seconds", None)
    return fill(sb.container_id) if fill is not None else None


def cool(sb) -> None:
    """Stop a paused sandbox's warm shell (the next resume starts it: a stopped shell's resume)."""
    from agentenv.backend.base import ContainerRef

    if not sb._rt.backend.cool(ContainerRef(sb.container_id, "")):
        raise RuntimeError(f"sandbox {sb.id}: its warm shell could not be stopped")
