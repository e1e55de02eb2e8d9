"""Config mistakes a user makes, on the command line or in a file of their own, each one line from the
trainer's real entry point (`rl.train.main`, in this process): ``k3rl-train: config error:``, the key,
where its value came from and the nearest valid names, exit code 2, before anything starts. And the
user's config folders: ``./conf`` of the working directory and ``--config-dir`` are read."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import yaml
from rl_testutil import ROOT

GUESS = yaml.safe_load((ROOT / "conf" / "env" / "guess_number.yaml").read_text())

# a user's task module: its own options, and one that drops SandboxTask's
USER_MODULE = textwrap.dedent('''
    import gymnasium

    from agentenv.tasks import Outcome, SandboxTask


    class Mistaken(SandboxTask):
        def __init__(self, num_files: int = 4, max_turns: int = 2, **kwargs):
            super().__init__(max_turns=max_turns, **kwargs)

        def setup(self, seed):
            return "hello"

        def act(self, action):
            return Outcome("bye", done=True)


    class Closed(Mistaken):
        def __init__(self, num_files: int = 4):
            super().__init__(num_files=num_files)


    gymnasium.register("mistakes/Mistaken-v0", entry_point=Mistaken)
    gymnasium.register("mistakes/Closed-v0", entry_point=Closed)
''')


def run_train(argv: list[str]) -> tuple[int, str]:
    """`python -m rl.train ARGV` in this process: (exit code, stdout + stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = ["rl.train", *argv]
    out = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules"
            try:
                runpy.run_module("rl.train", run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        GlobalHydra.instance().clear()
    return code, out.getvalue()


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A user's folder: a task module and configs under ./conf, the working directory of the test."""
    (tmp_path / "conf" / "env").mkdir(parents=True)
    (tmp_path / "mistakes_tasks.py").write_text(USER_MODULE)
    mine = {**GUESS, "max_episode_tokens": 77}
    (tmp_path / "conf" / "env" / "mine.yaml").write_text(yaml.safe_dump(mine))
    typo = {k: v for k, v in GUESS.items() if k != "max_new_tokens"} | {"max_new_token": 2}
    (tmp_path / "conf" / "env" / "typo.yaml").write_text(yaml.safe_dump(typo))
    task = {**GUESS, "id": "mistakes_tasks:mistakes/Mistaken-v0", "kwargs": {"num_file": 3}}
    (tmp_path / "conf" / "env" / "user_task.yaml").write_text(yaml.safe_dump(task))
    closed = {**GUESS, "id": "mistakes_tasks:mistakes/Closed-v0", "kwargs": {"num_files": 3}}
    (tmp_path / "conf" / "env" / "closed.yaml").write_text(yaml.safe_dump(closed))
    (tmp_path / "conf" / "env" / "broken.yaml").write_text("id: [\n")
    (tmp_path / "conf" / "env" / "based.yaml").write_text("defaults: [guess_numbr, _self_]\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


MISTAKES = [
    # a mistyped key on the command line: Hydra's "not in struct" (exit 1) before
    (["trainer.iteration=3"], "trainer.iteration: unknown key (command-line override trainer.iteration=3); "
     "did you mean trainer.iterations?"),
    # ... following Hydra's hint to add it
    (["+trainer.iteration=3"], "trainer.iteration: unknown key 'iteration' (no such setting in trainer) "
     "(command-line override +trainer.iteration=3); did you mean trainer.iterations?"),
    # an option that does not exist: no schema among the options offered
    (["env=find_valeu"], "env: no env option 'find_valeu' (command-line override env=find_valeu); did you "
     "mean find_value? (options: agent_guess_number, based, broken, closed, find_value, fix_code, "
     "guess_number, guess_number_32, kv_lookup, mine, reasoning_gym, store_recall, typo, user_task; files "
     "env/<option>.yaml in conf and ./conf)"),
    (["env=env_schema"], "env: env_schema is the schema of the env group (for `defaults:` of your own env "
     "files), not an option (command-line override env=env_schema)"),
    # a task option the task does not take: checked against its signature, not 22 s later in a worker
    (["+env.kwargs.num_valus=3"], "env.kwargs.num_valus: GuessNumber takes no option 'num_valus' "
     "(command-line override +env.kwargs.num_valus=3); did you mean env.kwargs.num_values? (its options: "),
    (["env.kwargs.num_valus=3"], "env.kwargs.num_valus: no such key to set (command-line override "
     "env.kwargs.num_valus=3); did you mean env.kwargs.num_values?; a new key is added with "
     "+env.kwargs.num_valus=3"),
    (["+env.kwargs.num_values=3"], "env.kwargs.num_values: already set, + adds only new keys (command-line "
     "override +env.kwargs.num_values=3); write env.kwargs.num_values=3"),
    (["sandbox.memry=1g"], "sandbox.memry: unknown key (command-line override sandbox.memry=1g); did you "
     "mean sandbox.memory?"),
    (["trainer.iterations=["], "command line: cannot read the override 'trainer.iterations=['"),
    (["--config-dir", "no_such_folder"], "--config-dir: no folder 'no_such_folder'"),
    (["preset=shrot"], "preset: no preset option 'shrot' (command-line override preset=shrot); did you mean "
     "short?"),
    # mistakes in the user's own files, named as the user sees them
    (["env=typo"], "env.max_new_token: unknown key 'max_new_token' (no such setting in env) "
     "(./conf/env/typo.yaml); did you mean env.max_new_tokens or env.max_episode_tokens?"),
    (["env=user_task"], "env.kwargs.num_file: Mistaken takes no option 'num_file' (./conf/env/user_task.yaml)"
     "; did you mean env.kwargs.num_files? (its options: command_timeout_s, max_action_chars, "
     "max_observation_chars, max_turns, num_files, session)"),
    (["env=closed"], "env.id: mistakes_tasks:mistakes/Closed-v0: Closed.__init__ takes no **kwargs, but the "
     "trainer passes every task the options of SandboxTask"),
    (["env=broken"], "./conf/env/broken.yaml, line 2: not valid YAML: expected the node content, but found "
     "'<stream end>' (while parsing a flow node)"),
    (["env=based"], "env: no env option 'guess_numbr' (the defaults of ./conf/env/based.yaml); did you mean "
     "guess_number or guess_number_32 or agent_guess_number?"),
]


@pytest.mark.parametrize(("argv", "line"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_each_mistake_is_one_line_with_exit_code_2(project, argv, line):
    code, out = run_train([*argv, "trainer.preflight=false"])
    assert code == 2, out[-3000:]
    assert out.strip().splitlines() == [out.strip()], f"more than one line:\n{out}"
    assert out.startswith(f"k3rl-train: config error: {line}"), out
    assert not (project / "outputs").exists()


def test_a_user_file_with_a_builtin_options_name_is_refused_not_silently_ignored(project):
    changed = {**GUESS, "max_episode_tokens": 50}
    (project / "conf" / "env" / "guess_number.yaml").write_text(yaml.safe_dump(changed))
    code, out = run_train(["--cfg", "job"])
    assert code == 2 and out.startswith(
        "k3rl-train: config error: env=guess_number: ./conf/env/guess_number.yaml has the name of k3rl's own "
        "env option (conf/env/guess_number.yaml), which is read first, so yours would be ignored; rename "
        "yours (e.g. my_guess_number.yaml)"), out
    # an identical copy (a checkout's conf/ beside the installed one) shadows nothing
    builtin = (ROOT / "conf" / "env" / "guess_number.yaml").read_text()
    (project / "conf" / "env" / "guess_number.yaml").write_text(builtin)
    assert run_train(["--cfg", "job"])[0] == 0


def test_the_working_directorys_conf_and_config_dir_are_read(project, tmp_path_factory):
    code, out = run_train(["env=mine", "--cfg", "job"])
    assert code == 0, out
    assert yaml.safe_load(out)["env"]["max_episode_tokens"] == 77
    other = tmp_path_factory.mktemp("elsewhere")
    (other / "env").mkdir()
    (other / "env" / "theirs.yaml").write_text(yaml.safe_dump({**GUESS, "max_episode_tokens": 78}))
    code, out = run_train(["--config-dir", str(other), "env=theirs", "--cfg", "job"])
    assert code == 0, out
    assert yaml.safe_load(out)["env"]["max_episode_tokens"] == 78


def test_the_console_script_imports_task_modules_from_the_working_directory(project):
    """`k3rl-train` (whose sys.path[0] is its bin folder, not the working directory) finds the user's task
    module as `python -m rl.train` does: the task-option check imports it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "k3rl-train"), "env=user_task"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "env.kwargs.num_file: Mistaken takes no option 'num_file'" in proc.stderr
