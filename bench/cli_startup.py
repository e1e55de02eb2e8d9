"""How long the `agentenv` command takes to start: `agentenv --help` and `agentenv ls` (an empty registry
in a temporary $AGENTENV_HOME), each the median wall time of --runs runs after one uncounted, against a
bare `python -c pass` (the interpreter's own start-up) timed in the same run, the three taken in turn so
that a change of load hits them alike. Target: each command within 0.15 s.

    python bench/cli_startup.py              # rewrites the `cli-startup` section of docs/benchmarks.md
    python bench/cli_startup.py --no-write   # print only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_report import busy_cores_before, other_load_text, write_section

SECTION = "cli-startup"
TARGET_S = 0.15
# what the verbs above must not load (the sandbox runtime, the server, the learner)
HEAVY = ("docker", "pydantic", "fastapi", "torch", "numpy")
HELP_PROBE = """
import contextlib, io, json, sys
from agentenv.cli import main
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    main(["--help"])
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def agentenv_command() -> str:
    """The `agentenv` entry point of this Python's environment."""
    path = Path(sys.executable).parent / "agentenv"
    if not path.is_file():
        raise SystemExit(f"cli_startup: no `agentenv` command beside {sys.executable}; run `make bootstrap`")
    return str(path)


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one run of ``argv`` (its output discarded); exits when it fails."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=60)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"cli_startup: {' '.join(argv)} failed (exit {done.returncode}): {done.stderr}")
    return elapsed


def loaded_heavy(env: dict[str, str]) -> list[str]:
    """Which of `HEAVY` the `--help` path loads (its modules after `agentenv --help`, in a subprocess)."""
    probe = HELP_PROBE.format(heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout.splitlines()[-1])


def measure(runs: int) -> tuple[dict[str, list[float]], list[str]]:
    """Each command's ``runs`` wall times (after one uncounted run each), and what `--help` loads."""
    agentenv = agentenv_command()
    with tempfile.TemporaryDirectory(prefix="k3rl-bench-cli-") as home:
        env = {**os.environ, "AGENTENV_HOME": home}
        env.pop("AGENTENV_SERVER", None)  # `ls` lists this machine's registry
        commands = {
            "`python -c pass` (the interpreter alone)": [sys.executable, "-c", "pass"],
            "`agentenv --help`": [agentenv, "--help"],
            "`agentenv ls` (an empty registry)": [agentenv, "ls"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for argv in commands.values():
            timed(argv, env)  # uncounted: the first `ls` makes the registry, caches warm up
        for _ in range(runs):
            for name, argv in commands.items():
                times[name].append(timed(argv, env))
        return times, loaded_heavy(env)


def report(times: dict[str, list[float]], heavy: list[str], command: str, busy: float) -> str:
    """The section's Markdown: a row per command, the target's verdicts, what `--help` loads."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = next(iter(medians.values()))
    lines = [
        f"Command: `{command}`. Python {platform.python_version()}, {os.cpu_count()} CPU cores "
        f"({platform.machine()}); load average {os.getloadavg()[0]:.1f} at the end; {other_load_text(busy)}",
        "",
        f"| command | median wall | p90 wall | less `python -c pass` | target <= {TARGET_S:g} s |",
        "|---|---|---|---|---|",
    ]
    for i, (name, t) in enumerate(times.items()):
        p90 = statistics.quantiles(t, n=10)[-1] if len(t) > 1 else t[0]
        verdict = "-" if i == 0 else f"**{'met' if medians[name] <= TARGET_S else 'missed'}**"
        extra = "-" if i == 0 else f"{medians[name] - base:.3f} s"
        lines.append(f"| {name} | {medians[name]:.3f} s | {p90:.3f} s | {extra} | {verdict} |")
    loaded = ", ".join(heavy) if heavy else "none"
    lines += ["", f"{len(next(iter(times.values())))} runs of each, after one uncounted. Of "
              f"{', '.join(HEAVY)}, `agentenv --help` loads: {loaded} (each verb imports what it needs "
              "when it runs; `tests/agentenv/test_cli_startup.py` checks it)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="timed runs of each command (default 21)")
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    busy = busy_cores_before()
    times, heavy = measure(args.runs)
    command = "python bench/cli_startup.py" + (f" --runs {args.runs}" if args.runs != 21 else "")
    text = report(times, heavy, command, busy)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
