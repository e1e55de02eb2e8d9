"""Every shell command in README.md and docs/*.md runs, at least as far as its argument parsing.

The commands are the lines of the ```sh / ```bash / ```console code blocks (in console blocks, the lines
after a `$ ` prompt). Each is dry-run by a rule for its program, so that a wrong key, option, target or
file fails here rather than for a reader:

- `make T [VAR=...]`: `make -n` must know the target; each recipe line it prints is checked in turn.
- Hydra entry points (`python -m rl.train ...`, `k3rl-train`, any module with `@hydra.main`): the real
  entry point runs in this process with `--cfg job` (Hydra parses the overrides and composes the config);
  for the trainer the composed config also goes through the trainer's own checks (`resolve_config`).
- other Python modules and scripts: the cheap read-only ones in RUN_FOR_REAL run for real, the rest
  with `--help`; path arguments must exist.
- `agentenv ...`: the CLI's own argument parser; `bash script`: `bash -n`; `pytest`/`ruff`: the
  executable and the paths named must exist.

Commands of one code block run in order in one working directory. A command whose output (`out=PATH`,
`hydra.run.dir=PATH`) a later command of its block names is a step of a pipeline: it runs for real, shrunk
by SHRINK to seconds, so that the later command is checked against what the earlier one really wrote.

Files a tutorial asks the reader to write (a code block whose first line is `# <path>`, e.g.
`# word_hunt.py` or `# conf/env/word_hunt.yaml`) are written to a scratch folder first, which stands for
the reader's working directory (`PYTHONPATH=.`) and extends Hydra's config search path.

The sections of `REAL_SECTIONS` are not dry-run here: their test runs every command of them for real,
in order, in a fresh folder (the task tutorial of docs/tasks.md: tests/rl/test_task_tutorial.py).

Also here: Markdown pointers to repository files must name files that exist, and a config that the
trainer rejects leaves no Hydra run folder behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELL_FENCES = {"sh", "bash", "console", "shell"}
RUN_FOR_REAL = {"model.count"}  # read-only and fast: the documented command itself runs
# Pipeline steps run for real with these overrides appended (program, a word it must contain) -> overrides.
SHRINK = {
    ("rl.sft.demonstrations", ""): ["num_episodes=4"],
    ("rl.train", "stage=sft"): ["sft.max_steps=1", "sft.checkpoint_every=0", "trainer.progress_bar=false"],
}
_WRITES = re.compile(r"^(?:out|hydra\.run\.dir)=(\S+)$")
# (doc, first heading, the heading it ends before) -> the test that runs its commands for real
REAL_SECTIONS = {("docs/tasks.md", "## Writing a task", "## Options every task accepts"):
                "tests/rl/test_task_tutorial.py"}
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_TUTORIAL_FILE = re.compile(r"\A# ([\w./-]+\.(?:py|yaml))\s*\n")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


@dataclass(frozen=True)
class DocCommand:
    doc: str
    line: int
    text: str
    output: str | None = None  # console blocks: the output shown after the command
    block: int = 0  # the first line of its code block: commands of one block share a working directory

    def writes(self) -> list[str]:
        """The paths this command's arguments say it writes."""
        return [m.group(1) for w in shlex.split(self.text, comments=True) if (m := _WRITES.match(w))]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _blocks() -> list[tuple[str, int, str, str]]:
    """(doc, first line number, fence language, body) of every fenced code block."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start(2)) + 1
            out.append((str(doc.relative_to(ROOT)), line, m.group(1).lower(), m.group(2)))
    return out


def _complete(text: str) -> bool:
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def run_for_real_lines(doc: str) -> list[tuple[int, int]]:
    """The line ranges of ``doc`` whose commands a test of `REAL_SECTIONS` runs for real."""
    lines = (ROOT / doc).read_text().splitlines()
    ranges = []
    for (name, start, end) in REAL_SECTIONS:
        if name == doc:
            first = lines.index(start) + 1
            last = next(i for i, line in enumerate(lines) if i >= first and line.startswith(end)) + 1
            ranges.append((first, last))
    return ranges


def doc_commands() -> list[DocCommand]:
    commands = []
    for doc, first, lang, body in _blocks():
        if lang not in SHELL_FENCES or any(a <= first < b for a, b in run_for_real_lines(doc)):
            continue
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            raw = lines[i]
            start = first + i
            i += 1
            if lang == "console":
                if not raw.startswith("$ "):
                    continue  # output
                raw = raw[2:]
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            text = raw
            while not _complete(text) and i < len(lines):
                text = text[:-1] + " " + lines[i].strip() if text.endswith("\\") else text + "\n" + lines[i]
                i += 1
            output = None
            if lang == "console":
                shown = []
                while i < len(lines) and not lines[i].startswith("$ "):
                    shown.append(lines[i])
                    i += 1
                output = "\n".join(shown).strip()
            commands.append(DocCommand(doc, start, text.strip(), output, first))
    return commands


def feeds(command: DocCommand) -> bool:
    """Whether a later command of its block names a path this one writes (a pipeline step)."""
    later_words = [w for c in COMMANDS
                   if (c.doc, c.block) == (command.doc, command.block) and c.line > command.line
                   for w in shlex.split(c.text, comments=True)]
    return any(w == path or w.endswith(f"={path}") for path in command.writes() for w in later_words)


def tutorial_files() -> dict[str, str]:
    """Relative path -> text of the files the docs ask the reader to write."""
    files = {}
    for _, _, _, body in _blocks():
        m = _TUTORIAL_FILE.match(body)
        if m:
            files[m.group(1)] = body
    return files


COMMANDS = doc_commands()


@pytest.fixture(scope="module")
def tutorial_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("reader")
    for rel, text in tutorial_files().items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


@dataclass
class Context:
    reader: Path  # the reader's working directory (tutorial files)
    env: dict[str, str]  # VAR=value prefixes of the command
    output: str | None = None  # the output the doc shows, for the commands that run for real

    def extra_overrides(self) -> list[str]:
        conf = self.reader / "conf"
        return [f"hydra.searchpath=[file://{conf}]"] if conf.is_dir() else []


@contextlib.contextmanager
def _sys_path(ctx: Context):
    added = [str(ctx.reader) if p in (".", "") else p for p in ctx.env.get("PYTHONPATH", "").split(":") if p]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            sys.path.remove(p)


@contextlib.contextmanager
def _environ(ctx: Context):
    """The command's VAR=value prefixes (other than PYTHONPATH) in this process's environment meanwhile."""
    added = {k: v for k, v in ctx.env.items() if k != "PYTHONPATH"}
    saved = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_main(target: str, argv: list[str], module: bool) -> tuple[int, str]:
    """Run a module or script as `__main__` in this process; (exit code, stdout + stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    saved = sys.argv
    sys.argv = [target, *argv]
    out = io.StringIO()
    code: int = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules"
            try:
                if module:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()
    return code, out.getvalue()


def _existing(path: str, ctx: Context) -> bool:
    return (ROOT / path).exists() or (ctx.reader / path).exists()


def _check_paths(args: list[str], ctx: Context, what: str) -> None:
    for a in args:
        if not a.startswith("-") and "=" not in a and ("/" in a or re.search(r"\.(ya?ml|py|md|sh|lock)$", a)):
            assert _existing(a, ctx), f"{what}: no file or folder {a!r}"


def check_make(args: list[str], ctx: Context) -> None:
    proc = subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"make -n {' '.join(args)}: {proc.stderr.strip()}"
    recipe = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("make")]
    assert recipe, f"make {' '.join(args)} runs nothing"
    for line in recipe:
        check(shlex.split(line), Context(ctx.reader, {}))


def check_hydra(target: str, args: list[str], ctx: Context, module: bool) -> None:
    overrides = [*args, *ctx.extra_overrides()]
    with _sys_path(ctx), _environ(ctx):
        code, out = _run_main(target, [*overrides, "--cfg", "job"], module)
        assert code == 0, f"{target} {' '.join(args)} --cfg job exited {code}:\n{out[-2000:]}"
        if target == "rl.train":
            from hydra import compose, initialize_config_dir

            from agentenv.paths import conf_dir
            from rl.train import resolve_config

            with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
                resolve_config(compose("config", overrides=overrides, return_hydra_config=True))


def check_python(args: list[str], ctx: Context) -> None:
    if args[:1] == ["-m"]:
        target, rest, module = args[1], args[2:], True
        spec = importlib.util.find_spec(target)
        assert spec and spec.origin, f"python -m {target}: no such module"
        source = Path(spec.origin).read_text()
    else:
        target, rest, module = args[0], args[1:], False
        assert _existing(target, ctx), f"python {target}: no such script"
        source = (ROOT / target).read_text()
        target = str(ROOT / target)
    if "@hydra.main" in source:
        return check_hydra(target, rest, ctx, module)
    _check_paths(rest, ctx, f"python {' '.join(args[:2])}")
    for_real = module and target in RUN_FOR_REAL
    # A fresh interpreter, as the reader's: scripts may change sys.path or import heavy modules. Read-only
    # commands run for real from the repository root; the others show their --help from the reader's folder.
    argv = rest if for_real else [*rest, "--help"]
    env = {**os.environ, **{k: str(ctx.reader) if v == "." else v for k, v in ctx.env.items()}}
    proc = subprocess.run([sys.executable, *(["-m"] if module else []), target, *argv],
                          cwd=ROOT if for_real else ctx.reader, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"python {' '.join(args)} ({' '.join(argv)}) exited {proc.returncode}:\n" + (
        proc.stdout + proc.stderr)[-2000:]
    if for_real and ctx.output:
        assert proc.stdout.strip() == ctx.output, f"the doc shows\n{ctx.output}\nbut it prints\n{proc.stdout}"


def check_agentenv(args: list[str]) -> None:
    from agentenv.cli import build_parser

    if "exec" in args and "--" in args[args.index("exec"):]:
        args = args[: args.index("--", args.index("exec"))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            build_parser().parse_args(args)
        except SystemExit as e:
            assert e.code in (0, None), f"agentenv {' '.join(args)}: {out.getvalue().strip()}"


def check_ray(args: list[str]) -> None:
    """`ray SUBCOMMAND ...`: Ray's own command-line parser (options and their types; the JSON of
    `--resources`); nothing starts."""
    import json

    with warnings.catch_warnings():  # Ray's CLI module imports Serve, which warns about pydantic
        warnings.simplefilter("ignore")
        from ray.scripts.scripts import cli

    assert args and args[0] in cli.commands, f"ray {args[:1]}: no such ray subcommand"
    command = cli.commands[args[0]]
    with command.make_context(f"ray {args[0]}", list(args[1:])) as parsed:
        if parsed.params.get("resources"):
            json.loads(parsed.params["resources"])


def check(cmd: list[str], ctx: Context) -> None:
    """Dry-run one command (already split into words)."""
    env = dict(ctx.env)
    while cmd and _ASSIGNMENT.match(cmd[0]):
        key, _, value = cmd.pop(0).partition("=")
        env[key] = value
    ctx = Context(ctx.reader, env, ctx.output)
    prog, args = cmd[0], cmd[1:]
    name = Path(prog).name
    if "/" in prog:
        assert (ROOT / prog).exists(), f"{prog}: no such program (run `make bootstrap`)"
    if name == "make":
        check_make(args, ctx)
    elif re.fullmatch(r"python(3(\.\d+)?)?", name):
        check_python(args, ctx)
    elif name == "k3rl-train":
        check_hydra("rl.train", args, ctx, module=True)
    elif name == "agentenv":
        check_agentenv(args)
    elif name == "bash":
        assert _existing(args[0], ctx), f"bash {args[0]}: no such script"
        proc = subprocess.run(["bash", "-n", str(ROOT / args[0])], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    elif name in ("pytest", "ruff"):
        _check_paths(args, ctx, name)
    elif name == "ray":
        check_ray(args)
    else:
        pytest.fail(f"no dry-run rule for {prog!r}: add one to {Path(__file__).name}")


def run_step(command: DocCommand) -> None:
    """Run a pipeline step for real, shrunk (SHRINK), in its block's working directory (cwd)."""
    words = shlex.split(command.text, comments=True)
    args = words[words.index("-m") + 1:] if "-m" in words else words[1:]
    target, rest = args[0], args[1:]
    extra = next((o for (prog, word), o in SHRINK.items()
                  if prog == target and (not word or word in rest)), None)
    assert extra is not None, f"{command}: a later command uses its output; add a SHRINK entry to run it"
    proc = subprocess.run([sys.executable, "-m", target, *rest, *extra], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"{command} (shrunk: {' '.join(extra)}) exited {proc.returncode}:\n" + (
        proc.stdout + proc.stderr)[-2000:]
    for path in command.writes():
        assert Path(path).exists(), f"{command}: wrote no {path}"


@pytest.fixture(scope="module")
def block_dirs() -> dict[tuple[str, int], tuple[Path, set[int]]]:
    """(doc, block) -> (its working directory, the lines of the pipeline steps already run there)."""
    return {}


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.doc}:{c.line}" for c in COMMANDS])
def test_documented_command_runs(command: DocCommand, tutorial_dir: Path, block_dirs, monkeypatch,
                                 tmp_path_factory) -> None:
    key = (command.doc, command.block)
    if key not in block_dirs:
        block_dirs[key] = (tmp_path_factory.mktemp("block"), set())
    workdir, done = block_dirs[key]
    monkeypatch.chdir(workdir)  # nothing a command may write lands in the repository
    lexer = shlex.shlex(command.text, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    operators = [t for t in lexer if t and set(t) <= set("();<>|&")]
    assert not operators and "$(" not in command.text, (
        f"{command}: write one plain command per line (found {operators or '$('}), so that it can be checked")
    for step in COMMANDS:  # the earlier steps of the pipeline, also when this test runs alone
        earlier = (step.doc, step.block) == key and step.line < command.line
        if earlier and step.line not in done and feeds(step):
            run_step(step)
            done.add(step.line)
    if feeds(command):
        if command.line not in done:
            run_step(command)
            done.add(command.line)
        return
    check(shlex.split(command.text, comments=True), Context(tutorial_dir, {}, command.output))


@pytest.mark.parametrize("text", [
    'make train ARGS="algo=ppo env=shell"',  # no such option of the env group
    'make train ARGS="trainer.max_iterations=50"',  # no such key
    'make train ARGS="algo.optim.lr=-1"',  # a value the trainer rejects
    "make no-such-target",
    ".venv/bin/python -m model.count conf/model/no_such_model.yaml",
    "agentenv pause --no-such-option",
    "docker ps",  # a program without a rule
])
def test_wrong_commands_are_caught(text: str, tutorial_dir: Path, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    from agentenv.errors import ConfigError

    with pytest.raises((AssertionError, pytest.fail.Exception, ConfigError)):
        check(shlex.split(text), Context(tutorial_dir, {}))


def test_docs_have_commands() -> None:
    assert len(COMMANDS) >= 8 and any(c.doc == "README.md" for c in COMMANDS)


# Pointers to repository files: code spans such as `agentenv/cli.py` or `conf/env/find_value.yaml`
# (from the repository root), and Markdown links such as [x](docs/y.md) (from the doc's own folder).
_TOP = ("agentenv", "rl", "model", "kernels", "conf", "docs", "scripts", "sandbox_images", "tests", "bench")
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(_TOP)})/[\w./<>*-]*)")


def doc_pointers() -> list[tuple[str, Path]]:
    """(doc, path) for every repository file or folder a doc names (the tutorial's own files aside)."""
    written = set(tutorial_files())
    out = []
    for doc in DOCS:
        text = doc.read_text()
        rel = str(doc.relative_to(ROOT))
        for span in _SPAN.findall(text):
            for path in _PATH.findall(span):
                path = path.rstrip(".,:")
                if path not in written and re.search(r"\.\w+$|/$", path):  # a file, or a folder/
                    out.append((rel, ROOT / re.split(r"[<*]", path)[0]))  # up to a <placeholder>
        for link in _LINK.findall(text):
            if not re.match(r"[a-z]+:|#", link):
                out.append((rel, doc.parent / link.split("#")[0]))
    return out


def test_doc_pointers_exist() -> None:
    pointers = doc_pointers()
    assert len(pointers) > 20
    missing = [f"{doc}: {path.relative_to(ROOT)}" for doc, path in pointers if not path.exists()]
    assert not missing, "docs point at files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("override", "message"),
    [("algo.optim.lr=-1", "algo.optim.lr"), ("rollout.temperature=0", "rollout.temperature: must be > 0")],
)
def test_rejected_config_leaves_no_run_folder(override: str, message: str, monkeypatch, tmp_path) -> None:
    """The trainer's real entry point: a bad config exits 2 with one line, before Hydra writes outputs/."""
    monkeypatch.chdir(tmp_path)
    code, out = _run_main("rl.train", [override], module=True)
    assert code == 2, out[-2000:]
    assert "k3rl-train: config error: " in out and message in out, out[-2000:]
    assert not (tmp_path / "outputs").exists(), os.listdir(tmp_path)
