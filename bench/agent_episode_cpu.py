"""What one episode of the shipped agent program (``env=agent_guess_number``) costs its sandbox in CPU: the
setup, the program's run (three turns against a stub chat API inside the sandbox) and the verifier's read,
beside python3's bare start, its start with the program's imports, and with ``http.client`` added (what a
stdlib HTTP client would cost each start). Each figure is the sandbox's cgroup CPU counter over --runs runs,
the stub's own CPU taken out, median (min-max) of --rounds rounds taken in turn. No target: it says where an
episode's CPU goes. Writes the ``agent-episode-cpu`` section of docs/benchmarks.md.

    python bench/agent_episode_cpu.py [--runs N] [--rounds K] [--no-write]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import statistics
from pathlib import Path

from bench_report import busy_cores_before, compose, other_load_text, training_machine, write_section

SECTION = "agent-episode-cpu"
PROGRAM = "agentenv.tasks.programs.guess_agent"
PORT = 4141
# answers every POST with a chat completion whose content is the next of 0..5, so games run three turns
STUB = f"""
import json, socket
server = socket.create_server(("127.0.0.1", {PORT}))
n = 0
while True:
    connection, _ = server.accept()
    with connection:
        request = connection.recv(65536)
        n += 1
        message = {{"role": "assistant", "content": str(n % 6)}}
        body = json.dumps({{"choices": [{{"message": message}}]}}).encode()
        connection.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
"""
# one line per measurement: KIND CPU_NS STUB_TICKS; the sandbox's CPU counter (cgroup v1 or v2)
SCRIPT = r"""
set -e
cd /workspace
cpu() {
  if [ -r /sys/fs/cgroup/cpuacct/cpuacct.usage ]; then cat /sys/fs/cgroup/cpuacct/cpuacct.usage
  else awk '/^usage_usec/ {print $2 * 1000}' /sys/fs/cgroup/cpu.stat; fi
}
python3 -S -c "$STUB" & stub=$!
i=0; until grep -q ":$(printf %04X "$PORT") 00000000:0000 0A" /proc/net/tcp; do
  i=$((i + 1)); [ $i -lt 200 ] || { echo "the stub API did not listen" >&2; exit 1; }; sleep 0.05
done
ticks() { awk '{print $14 + $15}' /proc/$stub/stat; }
export OPENAI_BASE_URL=http://127.0.0.1:$PORT/v1 OPENAI_API_KEY=bench OPENAI_MODEL=bench
measure() {
  kind=$1; shift; c0=$(cpu); s0=$(ticks); n=0
  while [ $n -lt "$RUNS" ]; do
    eval "$*" >/dev/null 2>&1 || { echo "$kind failed" >&2; exit 1; }; n=$((n + 1))
  done
  echo "$kind $(( $(cpu) - c0 )) $(( $(ticks) - s0 ))"
}
r=0
while [ $r -lt "$ROUNDS" ]; do
  measure episode 'rm -f .plays && AGENT_TASK=$(./guess.sh new $n 6) python3 -S agent.py --turns 3 \
    && cat .plays'
  measure bare "python3 -S -c pass"
  measure imports "python3 -S -c '$IMPORTS'"
  measure http "python3 -S -c '$IMPORTS, http.client, urllib.parse'"
  r=$((r + 1))
done
kill $stub
"""
KINDS = {
    "episode": "an episode: setup, the program's run (3 turns), the verifier's read",
    "bare": "python3 -S, nothing imported",
    "imports": "python3 -S with the program's imports",
    "http": "... and `http.client` (with `urllib.parse`)",
}
TICK_NS = 10_000_000  # /proc's utime and stime count 1/100 s


def program_imports() -> list[str]:
    """The top-level modules the shipped program imports (read from its source)."""
    tree = ast.parse(Path(importlib.util.find_spec(PROGRAM).origin).read_text())
    names = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
    names += [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module]
    return sorted(set(names))


def measure(runs: int, rounds: int) -> dict[str, list[float]]:
    """Per kind, the CPU milliseconds of one run in each round, in a sandbox of env=agent_guess_number."""
    from rl.rollout.wrappers import make_env

    cfg = compose(["env=agent_guess_number"])
    env = make_env(cfg.env.id, dict(cfg.env.kwargs), [])
    try:
        env.reset(seed=0)  # a sandbox with the program's files, as in training
        sandbox = env.unwrapped.sandbox
        variables = {"STUB": STUB, "PORT": str(PORT), "RUNS": str(runs), "ROUNDS": str(rounds),
                     "IMPORTS": "import " + ", ".join(program_imports())}
        done = sandbox.exec(["sh", "-c", SCRIPT], env=variables, timeout=60 + rounds * runs * 2.0)
    finally:
        env.close()
    if done.exit_code != 0:
        raise SystemExit(f"agent_episode_cpu: the measurement failed in the sandbox: {done.output[-2000:]}")
    out: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for line in done.stdout.splitlines():
        kind, cpu_ns, stub_ticks = line.split()
        out[kind].append((int(cpu_ns) - int(stub_ticks) * TICK_NS) / runs / 1e6)
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def section(ms: dict[str, list[float]], runs: int, rounds: int, machine: str, busy: float) -> str:
    added = [h - i for h, i in zip(ms["http"], ms["imports"], strict=True)]
    share = statistics.median(added) / statistics.median(ms["episode"])
    return "\n".join([
        "## An agent program's episode in its sandbox's CPU (`bench/agent_episode_cpu.py`)",
        "",
        f"Command: `python bench/agent_episode_cpu.py --runs {runs} --rounds {rounds}`. {machine}; "
        f"{other_load_text(busy)}",
        "",
        "One sandbox of `env=agent_guess_number` (its files installed by a reset, as in training); a stub "
        "chat API inside it answers each call at once, so that only the sandbox's side is counted (the "
        "stub's own CPU is taken out). Each figure: the sandbox's cgroup CPU counter over "
        f"{runs} runs, per run, median (min-max) of {rounds} rounds taken in turn. The program's imports: "
        f"`{', '.join(program_imports())}`. No target.",
        "",
        "| per run | CPU ms |",
        "|---|---|",
        *[f"| {label} | {spread(ms[kind])} |" for kind, label in KINDS.items()],
        f"| what `http.client` would add to each episode | {spread(added)} ({share:.0%} of an episode) |",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs of each kind per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each kind once per round, in turn)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1:
        parser.error("--runs and --rounds must be at least 1")
    busy, machine = busy_cores_before(), training_machine()
    ms = measure(args.runs, args.rounds)
    text = section(ms, args.runs, args.rounds, machine, busy)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
