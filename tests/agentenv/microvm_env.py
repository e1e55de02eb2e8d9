"""The microvm backend for a test module: `microvm_home` makes the block's sandboxes microVMs, in a registry
of their own (`$AGENTENV_HOME`), with `$AGENTENV_BACKEND=microvm` (inherited by the `agentenv serve` and
CLI subprocesses the tests start) and QEMU at niceness 10 (the host's other lane goes first). A host where
the backend cannot run fails the test with the reason (QEMU, the guest kernel and busybox-static are
installed by `make bootstrap`): never a skip. Imported by name (pytest puts this folder on sys.path;
tests/server inserts it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from agentenv.paths import conf_dir

ENV = ("AGENTENV_HOME", "AGENTENV_BACKEND", "AGENTENV_BACKEND_CONFIG")
# `agentenv_testutil.TOKEN_PROCESS` for a TCG guest: the same python3 that keeps a random token in a tmpfs
# file and sleeps, but the python3 that wrote the token forks the one that stays and exits, so the exec
# returns once the token is there. TOKEN_PROCESS's shell instead polls with `sleep 0.05`, a fork and an
# exec per round that a TCG guest's single vCPU takes from python's start: ~2.2 s (1.15 s of QEMU CPU)
# instead of ~1.4 s (0.8 s) in a fresh VM, seconds more on a loaded host.
TOKEN_PROCESS = ("nohup python3 -c \"import os,time; t=os.urandom(8).hex(); open('/tmp/token','w').write(t); "
                 "os.fork() and os._exit(0); time.sleep(10**6)\" >/dev/null 2>&1")


def resident_pages(path: Path) -> int:
    """Pages of a file in the page cache (util-linux `fincore`)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "PAGES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def backend_config(folder: Path, **overrides: object) -> Path:
    """conf/agentenv/backend.yaml with the microvm backend, QEMU at niceness 10, and `overrides`."""
    data = yaml.safe_load((conf_dir() / "agentenv" / "backend.yaml").read_text())
    data.update({"backend": "microvm", "microvm_nice": 10, **overrides})
    path = folder / "backend.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.contextmanager
def microvm_home(home: Path, **overrides: object) -> Iterator[Path]:
    """Sandboxes of this block run on the microvm backend in the registry at `home`; afterwards every VM of
    that registry is gone and the environment is as before."""
    from agentenv.runtime import runtime

    home.mkdir(parents=True, exist_ok=True)
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(AGENTENV_HOME=str(home), AGENTENV_BACKEND="microvm",
                      AGENTENV_BACKEND_CONFIG=str(backend_config(home, **overrides)))
    try:
        try:
            backend = runtime().backend
        except Exception as e:  # noqa: BLE001 - the reason is the test's failure
            pytest.fail(f"the microvm backend cannot run on this host: {e}")
        assert backend.name == "microvm", backend.name
        yield home
    finally:
        remove_vms(home)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def remove_vms(home: Path) -> list[str]:
    """Kill and delete every VM made for the registry at `home` (and the homes of servers below it)."""
    from agentenv.backend.microvm import qemu
    from agentenv.backend.microvm.vmdir import VmDir
    from agentenv.backend.settings import BackendSettings

    vms = BackendSettings.load().microvm_dir / "vms"
    gone = []
    for folder in vms.iterdir() if vms.exists() else ():
        owner = VmDir(vms, folder.name).meta.get("home", "")
        if owner and Path(owner).resolve().is_relative_to(home.resolve()):
            qemu.kill(folder)
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder.name)
    return gone
