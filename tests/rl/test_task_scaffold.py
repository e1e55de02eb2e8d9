"""`agentenv tasks new NAME`: the module, config and test it writes work as generated: the generated test
passes (gymnasium's env checker, the expert wins) and the task trains for an iteration, with its samples,
held-out games and own metrics; bad names and existing files are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rl_testutil import ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
AGENTENV = str(ROOT / ".venv" / "bin" / "agentenv")


def test_the_generated_task_passes_its_test_and_trains_an_iteration(local_ray, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    new = subprocess.run([AGENTENV, "tasks", "new", "digit_game"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert new.returncode == 0, new.stderr
    assert new.stdout.split() == ["digit_game.py", "conf/env/digit_game.yaml", "test_digit_game.py"]

    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_digit_game.py"]
    tested = subprocess.run(pytest_cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert tested.returncode == 0 and "2 passed" in tested.stdout, tested.stdout[-3000:]

    run_dir = tmp_path / "run"
    trained = subprocess.run(
        [sys.executable, "-m", "rl.train", "env=digit_game", "preset=short", "trainer.iterations=1",
         f"trainer.ray_address={local_ray}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "k3rl-train: pre-flight check of digit_game:user/DigitGame-v0 passed" in trained.stderr
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["failed_episodes"] == 0 and record["episodes"] == 8 and record["eval_episodes"] == 8
    assert {"DigitGame/looked", "DigitGame/invalid"} <= set(record)
    assert (run_dir / "samples.txt").read_text().count("--- episode ") == 2


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
