"""A bug in a user's task, reported at the user's line. The trainer's pre-flight check makes, resets and
steps one env before Ray starts, so the bug stops `python -m rl.train` in seconds with the frames of the
task's file, no run folder and no sandbox left. With the check off, the episodes fail in the rollout
workers: the run stops with the same frames on the console and in ``train.log``, and the run folder keeps
the metrics and the plot of the iteration it played. `agentenv tasks check` refuses a task that drops
SandboxTask's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rl_testutil import ROOT

sys.path.insert(0, str(ROOT / "tests" / "server"))
from netns_hosts import remove_labelled  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.slow]

TYPO_MODULE = textwrap.dedent('''\
    import gymnasium

    from agentenv.tasks import Outcome, SandboxTask


    class Typo(SandboxTask):
        in_place_reset = "nothing is written"

        def __init__(self, word: str = "gold", **kwargs):
            super().__init__(**kwargs)
            self.word = word

        def setup(self, seed: int) -> str:
            return "say gold"

        def act(self, action: str) -> Outcome:
            said = action.strip()
            return Outcome("ok", done=True, success=said == self.wrod)


    class Closed(Typo):
        def __init__(self, word: str = "gold", **kwargs):
            super().__init__(word=word)  # drops kwargs: the trainer's sandboxes never reach SandboxTask


    gymnasium.register("user/Typo-v0", entry_point=Typo)
    gymnasium.register("user/Closed-v0", entry_point=Closed)
''')
TYPO_LINE = ('  File "typo_task.py", line 18, in act\n'
             '    return Outcome("ok", done=True, success=said == self.wrod)')
CONFIG = ("id: typo_task:user/Typo-v0\ngroup_start: seed\nmax_new_tokens: 2\naction_vocabulary: gold\n"
          "max_episode_tokens: 64\nkwargs: {max_turns: 2}\n")


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "conf" / "env").mkdir(parents=True)
    (tmp_path / "typo_task.py").write_text(TYPO_MODULE)
    (tmp_path / "conf" / "env" / "typo.yaml").write_text(CONFIG)
    return tmp_path


def reader_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AGENTENV_HOME")}
    return env | {"AGENTENV_HOME": str(home), "PATH": f"{ROOT / '.venv' / 'bin'}:{env['PATH']}",
                  "RAY_AUTH_MODE": "disabled"}


def test_the_preflight_check_stops_a_broken_task_in_seconds_at_its_line(task_home, project, tmp_path):
    home = tmp_path / "home"
    env = reader_env(home)
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "rl.train", "env=typo", "preset=short"], cwd=project,
                              env=env, capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - started
        listed = subprocess.run(["agentenv", "ls", "--json", "--all"], cwd=project, env=env,
                                capture_output=True, text=True, timeout=60)
    finally:
        remove_labelled(home)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr == (
        "k3rl-train: task error (pre-flight check of typo_task:user/Typo-v0): env.step('g') raised "
        f"AttributeError: 'Typo' object has no attribute 'wrod'\n{TYPO_LINE}\n")
    assert took < 60, took  # the imports, one sandbox, a reset and a step: no Ray
    assert not (project / "outputs").exists()
    rows = json.loads(listed.stdout)
    assert rows and all(r["state"] == "closed" for r in rows), rows  # its sandbox was made and closed


def test_a_task_that_fails_in_training_stops_the_run_at_its_line_and_keeps_its_metrics(local_ray, project):
    run_dir = project / "run"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "rl.train", "env=typo", "preset=short", "trainer.preflight=false",
         f"trainer.ray_address={local_ray}", f"hydra.run.dir={run_dir}"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the workers of a joined cluster run elsewhere than the driver: the file is named by its full path
    frames = TYPO_LINE.replace('"typo_task.py"', f'"{project / "typo_task.py"}"')
    summary = ("iteration 0: 8 of 8 episodes failed, more than rollout.max_failed_fraction=0.5.\n"
               "most common errors:\n  8 x AttributeError: 'Typo' object has no attribute 'wrod'\n"
               + "\n".join(f"    {line}" for line in frames.splitlines()))
    assert f"k3rl-train: training stopped: {summary}\n" in proc.stderr
    assert f"k3rl-train: metrics and plot so far are in {run_dir}" in proc.stderr
    assert f"training stopped: {summary}" in (run_dir / "train.log").read_text()
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["iteration"] == 0 and record["failed_episodes"] == 8 and record["failed_runtime_error"] == 8
    assert (run_dir / "learning_curve.png").is_file()


def test_the_check_refuses_a_task_that_drops_its_kwargs(task_home, project):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    agentenv = str(ROOT / ".venv" / "bin" / "agentenv")
    proc = subprocess.run([agentenv, "tasks", "check", "typo_task:user/Closed-v0"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("agentenv: error: Closed.__init__ does not pass its **kwargs on to "
                                  "super().__init__"), proc.stderr
