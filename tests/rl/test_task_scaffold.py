"""`agentenv tasks new NAME`: the module, config and test it writes work as generated: the generated test
passes (gymnasium's env checker, the expert wins); bad names and existing files are refused. (That such a
task trains, with its samples, held-out games and own metrics, is the tutorial's test.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rl_testutil import ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
AGENTENV = str(ROOT / ".venv" / "bin" / "agentenv")


def test_the_generated_task_passes_its_own_test(tmp_path):
    """(Training a scaffolded task, edited as the tutorial edits it, is `test_task_tutorial`'s run.)"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    new = subprocess.run([AGENTENV, "tasks", "new", "digit_game"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert new.returncode == 0, new.stderr
    assert new.stdout.split() == ["digit_game.py", "conf/env/digit_game.yaml", "test_digit_game.py"]

    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_digit_game.py"]
    tested = subprocess.run(pytest_cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert tested.returncode == 0 and "2 passed" in tested.stdout, tested.stdout[-3000:]


@pytest.mark.parametrize(("name", "error"), [
    ("Word-Hunt", "task name 'Word-Hunt': use lower-case letters, digits and _"),
    ("class", "task name 'class': use lower-case letters"),
    ("json", "task name 'json': a module of that name is importable already"),
])
def test_bad_task_names_are_refused(tmp_path, name, error):
    proc = subprocess.run([AGENTENV, "tasks", "new", name], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith(f"agentenv: error: {error}"), proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_existing_files_are_not_overwritten(tmp_path):
    (tmp_path / "mine.py").write_text("# my own work\n")
    proc = subprocess.run([AGENTENV, "tasks", "new", "mine"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "mine.py exist(s) already" in proc.stderr
    assert (tmp_path / "mine.py").read_text() == "# my own work\n" and not (tmp_path / "conf").exists()
