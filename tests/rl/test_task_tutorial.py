"""docs/tasks.md's task tutorial, played as a reader would: every code block from "Writing a task" up to
"Options every task accepts", in order, exactly as printed, in a fresh folder outside the repository
with an AgentENV home of its own. A block whose first line is ``# <path>`` is written to that path
(over what the scaffold wrote: the reader's edit); each line of a shell block runs with bash (``python``
and ``agentenv`` are the project's, as for a reader with its venv active) and must succeed; each command
of a console block must print exactly the output shown, with exit code 2 for a config error and 1 for a
task error. Then what the path left is checked: the samples and metrics it promises, the expert's
demonstrations, and no sandbox. The wall time of each step and of the whole path is printed (`-s`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
from rl_testutil import ROOT

sys.path.insert(0, str(ROOT / "tests" / "server"))
from netns_hosts import remove_labelled  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.slow]

DOC = ROOT / "docs" / "tasks.md"
START, END = "## Writing a task", "## Options every task accepts"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_FILE = re.compile(r"\A# ([\w./-]+\.(?:py|yaml))\s*\n")


def tutorial_blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of the tutorial's sections, in order."""
    text = DOC.read_text()
    begin = text.index(f"\n{START}\n")
    section = text[begin : text.index(f"\n{END}", begin)]
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(section)]


def shell_lines(body: str) -> list[str]:
    """The commands of a shell block: its lines, comments and blanks aside, continuations joined."""
    out, pending = [], ""
    for line in body.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append(pending.strip())
            pending = ""
    return out


def console_steps(body: str) -> list[tuple[str, str]]:
    """(command, the output shown) of each ``$ `` line of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return [(cmd, "\n".join(shown).strip()) for cmd, shown in steps]


def test_the_tutorial_blocks_are_files_and_commands():
    """Every block of the tutorial is something this test runs: a file to write, or commands."""
    blocks = tutorial_blocks()
    kinds = [lang if lang in ("bash", "console") else "file" for lang, body in blocks if
             lang in ("bash", "console") or _FILE.match(body)]
    assert len(kinds) == len(blocks), [lang for lang, _ in blocks]
    assert kinds.count("file") == 2 and kinds.count("console") >= 4


def test_the_task_tutorial_runs_as_printed(task_home, tmp_path):
    folder = tmp_path / "my_project"  # the reader's fresh folder, outside the repository
    folder.mkdir()
    home = tmp_path / "agentenv-home"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AGENTENV_HOME")}
    env |= {"AGENTENV_HOME": str(home), "PATH": f"{ROOT / '.venv' / 'bin'}:{env['PATH']}",
            "RAY_AUTH_MODE": "disabled"}
    timings: list[tuple[float, str]] = []
    outputs: dict[str, str] = {}
    started = time.perf_counter()
    try:
        for lang, body in tutorial_blocks():
            written = _FILE.match(body)
            if written:
                (folder / written.group(1)).parent.mkdir(parents=True, exist_ok=True)
                (folder / written.group(1)).write_text(body)
                continue
            if lang == "bash":
                for command in shell_lines(body):
                    t = time.perf_counter()
                    proc = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True,
                                          text=True, timeout=600)
                    timings.append((time.perf_counter() - t, command))
                    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-3000:]}" \
                                                 f"\n{proc.stderr[-3000:]}"
                    outputs[command] = proc.stdout + proc.stderr
                continue
            for command, shown in console_steps(body):
                t = time.perf_counter()
                proc = subprocess.run(shlex.split(command), cwd=folder, env=env, capture_output=True,
                                      text=True, timeout=300)
                timings.append((time.perf_counter() - t, command))
                printed = (proc.stdout + proc.stderr).strip()
                assert printed == shown, f"{command}: the doc shows\n{shown}\nbut it prints\n{printed}"
                assert proc.returncode == (2 if "config error" in shown else 1), (command, proc.returncode)
        total = time.perf_counter() - started
        listed = subprocess.run(["agentenv", "ls", "--json"], cwd=folder, env=env, capture_output=True,
                                text=True, timeout=60)  # before the clean-up below, which would hide a leak
    finally:
        remove_labelled(home)  # whatever a failed step left (the assertions below check nothing was)
    print(f"\nthe task tutorial of {DOC.name}: {total:.1f} s in all")
    for seconds, command in timings:
        print(f"  {seconds:6.1f} s  {command}")

    # the scaffold, the check and its test
    assert "gymnasium's env checker passed" in outputs["agentenv tasks check conf/env/word_hunt.yaml"]
    assert "2 passed" in outputs["python -m pytest -q -p no:cacheprovider test_word_hunt.py"]
    # the short run: its samples, metrics (held-out games, cut episodes, the task's own numbers)
    run = folder / "runs" / "word_hunt"
    samples = (run / "samples.txt").read_text()
    assert [int(i) for i in re.findall(r"^=== iteration (\d+)", samples, re.M)] == [0, 1]
    assert samples.count("--- episode ") == 4 and "observation 0:\n    which file 1-4 holds gold?" in samples
    assert re.search(r"^action 1: '[1-4!]*'", samples, re.M) and "ended: " in samples
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1] and all(r["episodes"] == 8 for r in records)
    for record in records:
        assert record["eval_episodes"] == 8 and 0 <= record["eval_success"] <= 1
        assert record["episodes_cut_by_tokens"] + record["episodes_cut_by_max_turns"] <= 8
        assert 0 <= record["WordHunt/looked"] <= 1
    assert records[0]["sandboxes_created"] >= 1  # in-place resets: made once, kept
    table = outputs["python -m rl.metrics runs/word_hunt"]
    assert "eval_success" in table and "WordHunt/looked" in table
    # the expert's demonstrations: the config's function, every game won
    demos = [json.loads(line) for line in (folder / "demos.jsonl").read_text().splitlines()]
    assert len(demos) == 20 and all(d["success"] and d["expert"] == "expert" for d in demos)
    # no sandbox left: `agentenv ls` (run by the doc) listed none, and the registry agrees
    assert outputs["agentenv ls"].split() == ["ID", "STATE", "IMAGE", "USER", "PARENT"]
    assert json.loads(listed.stdout) == []
