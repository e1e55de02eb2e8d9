"""The policy gateway's cost (`rl.rollout.gateway`): what the HTTP API adds to a call over the engine alone,
and the generated tokens/s of many concurrent agent programs against the trainer's own rollout batch.

Both on ``make train``'s policy (the default config, seed 0) with a `TorchEngine`, the gateway served by
uvicorn on a loopback port in this process, the clients the real `openai` SDK (async, one client each):

1. **Overhead per call**: ``--calls`` chat completions one after another (``max_tokens`` =
   ``--new-tokens``, batch window 0); each call's wall time at the client minus the engine's time for
   the batch that sampled it (the engine is wrapped to time each ``generate``): p50 and p90.
2. **Concurrent programs**: ``--clients`` agent programs, each a process of its own as in training (where
   each runs in its own sandbox), play ``--turns`` turns: each turn one chat completion, sent as soon as
   the last one answered (no barrier between programs). Their generated tokens/s over the run against
   the trainer's rollout of the same turns: one ``engine.generate`` per turn over the same prompts
   (rendered by the gateway's chat template) at the same batch. ``--rounds`` runs of each side,
   alternated; median of each side, its range, and the median of the per-round ratios. Where the CPU
   goes (/proc's user + system time): each program's per call (the SDK's own work), the gateway's event
   loop thread's per call (HTTP, JSON, chat template, capture), and each side's whole round.
3. **The same with light programs** (informative, no target): part 2 with programs that call the API
   with the shipped example agent's client (a plain socket, `agentenv.tasks.programs.guess_agent.post`)
   instead of the SDK.

Targets: overhead p50 <= 5 ms; concurrent programs' tokens/s >= 0.9x the rollout batch's.

    python bench/gateway.py              # ~4 min on 2 cores; writes the `gateway` section
    python bench/gateway.py --no-write   # print only
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported by a test: after the checkout, so that
    sys.path.append(str(Path(__file__).resolve().parent))  # bench/model.py never shadows model/
from bench_report import busy_cores_before, compose, other_load_text, training_machine, write_section  # noqa: E402
from gateway_program import messages  # noqa: E402

SECTION = "gateway"
MODEL = "k3rl-policy"
OVERHEAD_TARGET_MS = 5.0
THROUGHPUT_TARGET = 0.9


class TimedEngine:
    """The real engine, with the wall time of each ``generate`` call kept (the batch's engine time)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model = engine.model
        self.calls: list[float] = []

    def generate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.calls.append(time.perf_counter() - start)


class Served:
    """A `Gateway`'s API on a free loopback port (uvicorn in a thread) for a ``with`` block."""

    def __init__(self, gateway) -> None:
        import uvicorn

        from rl.rollout.gateway.app import create_app

        self.server = uvicorn.Server(uvicorn.Config(create_app(gateway), host="127.0.0.1", port=0,
                                                    log_level="warning"))  # fmt: skip
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        self.stat = f"/proc/self/task/{self.thread.native_id}/stat"  # the event loop's thread
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise SystemExit("bench/gateway.py: the gateway did not start on 127.0.0.1")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def cpu_seconds(stat: str) -> float:
    """User plus system CPU seconds of a process or thread, from its ``/proc/.../stat``."""
    from agentenv.backend.ksm import stat_cpu_seconds

    return stat_cpu_seconds(Path(stat).read_text())


def gateway_for(engine, tokenizer, window_s: float, rows: int, new_tokens: int):
    from rl.rollout.gateway.service import Gateway
    from rl.rollout.gateway.settings import GatewaySettings

    settings = GatewaySettings(model_name=MODEL, context_tokens=engine.model.config.max_position_embeddings,
                               max_tokens=new_tokens, max_n=1, batch_window_s=window_s, max_batch_rows=rows,
                               open_access=True, seed=0)  # fmt: skip
    return Gateway(engine, tokenizer, settings)


async def chat(client, i: int, new_tokens: int) -> int:
    response = await client.chat.completions.create(model=MODEL, messages=messages(i, 0),
                                                    max_tokens=new_tokens)  # fmt: skip
    return response.usage.completion_tokens


def overhead(engine, tokenizer, calls: int, new_tokens: int) -> list[float]:
    """Milliseconds each sequential call spent outside the engine (see the module docstring, part 1)."""
    from openai import AsyncOpenAI

    timed = TimedEngine(engine)
    gateway = gateway_for(timed, tokenizer, 0.0, 1, new_tokens)
    out: list[float] = []
    with Served(gateway) as url:

        async def run() -> None:
            client = AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=60)
            for i in range(calls + 1):  # the first is uncounted (first-call allocations)
                before = len(timed.calls)
                start = time.perf_counter()
                await chat(client, i, new_tokens)
                wall = time.perf_counter() - start
                if i and len(timed.calls) == before + 1:
                    out.append((wall - timed.calls[-1]) * 1000)
            await client.close()

        asyncio.run(run())
    return out


def render_prompts(tokenizer, clients: int, turns: int) -> list[list[list[int]]]:
    """Each turn's prompts of the ``clients`` programs, as the gateway's chat template renders them."""
    from rl.rollout.gateway.bodies import chat_request
    from rl.rollout.gateway.chat_format import render_chat

    return [[render_chat(chat_request({"model": MODEL, "messages": messages(i, turn)}, clients).messages,
                         None, tokenizer) for i in range(clients)] for turn in range(turns)]  # fmt: skip


def engine_run(engine, prompts: list[list[list[int]]], new_tokens: int, seed: int,
               cpu: list[float] | None = None) -> tuple[int, float]:  # fmt: skip
    """The trainer's rollout of the same turns: one batch per turn. (tokens, seconds); the CPU seconds
    this process spent are appended to ``cpu``."""
    import torch

    generator, tokens = torch.Generator().manual_seed(seed), 0
    start, cpu_start = time.perf_counter(), cpu_seconds("/proc/self/stat")
    for turn_prompts in prompts:
        tokens += sum(len(g.token_ids) for g in engine.generate(turn_prompts, new_tokens, generator))
    if cpu is not None:
        cpu.append(cpu_seconds("/proc/self/stat") - cpu_start)
    return tokens, time.perf_counter() - start


def concurrent(engine, tokenizer, clients: int, turns: int, rounds: int, new_tokens: int,
               window_s: float, client: str = "openai") -> dict:  # fmt: skip
    """Tokens/s of ``clients`` program processes (``client``: their HTTP client, see
    `gateway_program`) and of the rollout's batches of the same turns."""
    import json
    import subprocess

    prompts = render_prompts(tokenizer, clients, turns)
    gateway = gateway_for(engine, tokenizer, window_s, clients, new_tokens)
    rates: dict[str, list[float]] = {"gateway": [], "engine": []}
    batches: list[int] = []
    cpu: dict[str, list[float]] = {"programs": [], "loop": []}  # ms per call
    cpu_s: dict[str, list[float]] = {"gateway": [], "engine": []}  # CPU seconds of a round, every process
    script = str(Path(__file__).resolve().parent / "gateway_program.py")
    with (served := Served(gateway)) as url:
        procs = [subprocess.Popen([sys.executable, script, url, MODEL, str(i), str(turns), str(new_tokens),
                                   client],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in range(clients)]  # fmt: skip

        def answer(p: subprocess.Popen) -> dict:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"bench/gateway.py: an agent program exited (code {p.wait()})")
            return json.loads(line)

        def gateway_run(counted: bool = True) -> tuple[int, float]:
            stats = [f"/proc/{p.pid}/stat" for p in procs]
            before = (sum(map(cpu_seconds, stats)), cpu_seconds(served.stat), cpu_seconds("/proc/self/stat"))
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            got = [answer(p) for p in procs]
            programs = sum(map(cpu_seconds, stats)) - before[0]
            loop, process = cpu_seconds(served.stat) - before[1], cpu_seconds("/proc/self/stat") - before[2]
            if counted:
                calls = clients * turns
                cpu["programs"].append(programs / calls * 1000)
                cpu["loop"].append(loop / calls * 1000)
                cpu_s["gateway"].append(programs + process)
            return sum(g["tokens"] for g in got), max(g["ended"] for g in got) - min(g["began"] for g in got)

        try:
            for p in procs:
                answer(p)  # ready: its imports are done
            gateway_run(counted=False)  # warm-up of both sides, uncounted
            engine_run(engine, prompts, new_tokens, 10_000)
            for r in range(rounds):
                for side in ("gateway", "engine") if r % 2 == 0 else ("engine", "gateway"):
                    if side == "gateway":
                        seen = len(gateway.batcher.batch_sizes)
                        tokens, wall = gateway_run()
                        batches += list(gateway.batcher.batch_sizes)[seen:]
                    else:
                        tokens, wall = engine_run(engine, prompts, new_tokens, r, cpu_s["engine"])
                    rates[side].append(tokens / wall)
        finally:
            for p in procs:
                p.stdin.close()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    ratios = [g / e for g, e in zip(rates["gateway"], rates["engine"], strict=True)]
    return {"rates": rates, "ratios": ratios, "batches": batches, "cpu": cpu, "cpu_s": cpu_s}


def spread(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40, help="sequential calls of the overhead part")
    ap.add_argument("--clients", type=int, default=64, help="concurrent agent programs")
    ap.add_argument("--turns", type=int, default=4, help="turns each program plays in a round")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of the concurrent parts (each side)")
    ap.add_argument("--new-tokens", type=int, default=16, help="max_tokens of every call")
    ap.add_argument("--window-ms", type=float, default=5.0, help="the batcher's window, concurrent part")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    for name in ("calls", "clients", "turns", "rounds", "new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    import torch

    from rl.policy import build_policy
    from rl.rollout.torch_engine import TorchEngine
    from rl.tokenizer import build_tokenizer

    machine, busy = training_machine(), busy_cores_before()
    cfg = compose([])
    tokenizer = build_tokenizer(cfg.tokenizer)
    engine = TorchEngine(build_policy(cfg.model, seed=0).eval(), tokenizer)
    torch.manual_seed(0)
    started = time.perf_counter()
    extra = overhead(engine, tokenizer, args.calls, args.new_tokens)
    conc = concurrent(engine, tokenizer, args.clients, args.turns, args.rounds, args.new_tokens,
                      args.window_ms / 1000)
    light = concurrent(engine, tokenizer, args.clients, args.turns, args.rounds, args.new_tokens,
                       args.window_ms / 1000, client="stdlib")
    total = time.perf_counter() - started

    p50, p90 = statistics.median(extra), sorted(extra)[int(0.9 * (len(extra) - 1))]
    ratio = statistics.median(conc["ratios"])
    params = sum(p.numel() for p in engine.model.parameters())
    batches = conc["batches"]
    command = " ".join(["python bench/gateway.py", *(sys.argv[1:] if argv is None else argv)])
    body = "\n".join([
        f"Command: `{command}`. {machine}; {other_load_text(busy).rstrip('.')}.",
        "",
        f"`make train`'s policy (the default config's model, {params:,} parameters, seed 0) in a "
        "`TorchEngine`, the gateway (`rl.rollout.gateway`) served by uvicorn on 127.0.0.1 in the bench's "
        "process, clients the `openai` SDK (async), each call a chat completion of at most "
        f"{args.new_tokens} tokens. Concurrent programs: {args.clients} processes, {args.turns} turns each "
        "per round.",
        "",
        "| | figure |",
        "|---|---|",
        f"| overhead per call over the engine alone, {len(extra)} sequential calls (p50 / p90) | "
        f"{p50:.2f} ms / {p90:.2f} ms |",
        f"| {args.clients} concurrent programs, generated tokens/s (median, min-max of {args.rounds} rounds) "
        f"| {spread(conc['rates']['gateway'])} |",
        f"| the rollout of the same turns, one `engine.generate` of {args.clients} prompts per turn | "
        f"{spread(conc['rates']['engine'])} |",
        f"| ratio, median of the rounds' pairs (min-max) | {spread(conc['ratios'], '.2f')}x |",
        f"| the batcher's engine calls per round, rows each (window {args.window_ms:g} ms) | "
        f"{len(batches) / args.rounds:.1f} calls, rows {spread([float(b) for b in batches], '.0f')} |",
        f"| CPU per call in the concurrent rounds (median, min-max): an agent program (the `openai` SDK) | "
        f"{spread(conc['cpu']['programs'], '.2f')} ms |",
        "| the gateway's event loop (HTTP, JSON, chat template, capture) | "
        f"{spread(conc['cpu']['loop'], '.2f')} ms |",
        "| CPU seconds of a round, every process (median): the rollout's / the programs' and the gateway's | "
        f"{statistics.median(conc['cpu_s']['engine']):.2f} / "
        f"{statistics.median(conc['cpu_s']['gateway']):.2f} |",
        f"| (no target) the same with programs on the shipped example agent's client (a plain socket): ratio "
        f"(median, min-max); an agent program's CPU per call | {spread(light['ratios'], '.2f')}x; "
        f"{spread(light['cpu']['programs'], '.2f')} ms |",
        "",
        f"Targets: overhead p50 <= {OVERHEAD_TARGET_MS:g} ms "
        f"({p50:.2f} ms: {verdict(p50 <= OVERHEAD_TARGET_MS)}); "
        f"concurrent programs >= {THROUGHPUT_TARGET}x the rollout batch's tokens/s ({ratio:.2f}x: "
        f"{verdict(ratio >= THROUGHPUT_TARGET)}).",
        "",
        f"(total {total:.0f} s)",
    ])
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
