"""`agentenv ls --label KEY[=VALUE]` and `--owner PID|gone` filter the registry's sandboxes (those of a run
or a check, those a killed process left for `agentenv gc`), still without loading the sandbox runtime."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agentenv.owner import OWNER_LABEL, owner_labels
from agentenv.registry import Registry

HEAVY = ("docker", "torch", "agentenv.sandbox", "agentenv.backend.runtime", "agentenv.remote")
PROBE = """
import contextlib, io, json, sys
from agentenv.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "loaded": [m for m in HEAVY if m in sys.modules]}))
"""


def ls(home: Path, *argv: str) -> dict:
    env = {"AGENTENV_HOME": str(home), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}", "ls", *argv], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def ids(result: dict) -> list[str]:
    assert result["code"] == 0 and result["loaded"] == [], result
    return sorted(row["id"] for row in json.loads(result["out"]))


def test_ls_filters_by_label_and_by_owner(tmp_path):
    registry = Registry(tmp_path)
    mine = owner_labels()[OWNER_LABEL]  # this test's process: alive
    gone = "another-boot:12345:678"  # a process of an earlier boot: gone
    rows = {"a1": {"team": "a", OWNER_LABEL: mine}, "b2": {"team": "b", OWNER_LABEL: gone},
            "c3": {"team": "a"}}
    for sid, labels in rows.items():
        registry.insert_sandbox(id=sid, state="running", image="k3rl/base:1", user="agent", config={},
                                labels=labels)
    assert ids(ls(tmp_path, "--json")) == ["a1", "b2", "c3"]
    assert ids(ls(tmp_path, "--json", "--label", "team=a")) == ["a1", "c3"]
    assert ids(ls(tmp_path, "--json", "--label", "team")) == ["a1", "b2", "c3"]
    assert ids(ls(tmp_path, "--json", "--label", "team=a", "--label", OWNER_LABEL)) == ["a1"]
    assert ids(ls(tmp_path, "--json", "--owner", "gone")) == ["b2"]
    assert ids(ls(tmp_path, "--json", "--owner", str(os.getpid()))) == ["a1"]
    table = ls(tmp_path, "--owner", "gone")["out"].splitlines()
    assert len(table) == 2 and table[1].split()[0] == "b2"
    bad = ls(tmp_path, "--owner", "someone")
    assert bad["code"] == 1 and "--owner expects a process id or `gone`" in bad["err"]
