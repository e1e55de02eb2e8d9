"""The `agentenv` command starts without the heavy modules: `--help` and `ls` (which reads the registry
alone) load neither the Docker SDK nor the server's, the learner's or the sandbox runtime's modules, so
their start-up is the interpreter's and a few milliseconds (bench/cli_startup.py times it). Checked
in a subprocess's sys.modules, not by a clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agentenv.registry import Registry

HEAVY = ("docker", "requests", "pydantic", "fastapi", "torch", "numpy", "agentenv.sandbox",
         "agentenv.backend.runtime", "agentenv.remote", "agentenv.backend.images",
         "agentenv.runtime")

PROBE = """
import contextlib, io, json, sys
from agentenv.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "out": out.getvalue(), "loaded": [m for m in HEAVY if m in sys.modules]}))
"""


def run_cli(home: Path, *argv: str) -> dict:
    """`agentenv ARGV` in a fresh interpreter: its exit code, its output and which `HEAVY` modules it
    loaded."""
    env = {"AGENTENV_HOME": str(home), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}", *argv], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_help_loads_none_of_the_heavy_modules(tmp_path):
    seen = run_cli(tmp_path, "--help")
    assert seen["code"] == 0 and "create, exec, pause, resume, fork" in seen["out"]
    assert seen["loaded"] == []


def test_ls_reads_the_registry_without_the_runtime(tmp_path):
    Registry(tmp_path).insert_sandbox(id="abc123def456", state="paused", image="k3rl/base:1", user="agent",
                                      config={}, labels={"team": "a"})
    seen = run_cli(tmp_path, "ls", "--json")
    assert seen["code"] == 0 and seen["loaded"] == []
    (row,) = json.loads(seen["out"])
    assert {k: row[k] for k in ("id", "state", "image", "user", "parent", "labels", "container")} == {
        "id": "abc123def456", "state": "paused", "image": "k3rl/base:1", "user": "agent", "parent": None,
        "labels": {"team": "a"}, "container": ""}
    table = run_cli(tmp_path, "ls")["out"].splitlines()
    assert table[0].split() == ["ID", "STATE", "IMAGE", "USER", "PARENT"]
    assert table[1].split() == ["abc123def456", "paused", "k3rl/base:1", "agent", "-"]
