"""The policy gateway's cost (`rl.rollout.gateway`): what the HTTP API adds to a call over the engine alone,
and
the generated tokens/s of many concurrent agent programs against the trainer's own rollout batch.

Both on ``make train``'s policy (the default config, seed 0) with a `TorchEngine`, the gateway served by
uvicorn on a loopback port in this process, the clients the real `openai` SDK (async, one client each):

1. **Overhead per call**: ``--calls`` chat completions one after another (``max_tokens`` =
   ``--new-tokens``, batch window 0); each call's wall time at the client minus the engine's time for
   the batch that sampled it (the engine is wrapped to time each ``generate``): p50 and p90.
2. **Concurrent programs**: ``--clients`` programs each send one chat completion at once (a round); the
   generated tokens/s of the round against one ``engine.generate`` of the same prompts (rendered by the
   gateway's chat template) in one batch, as a rollout turn of the trainer samples them. ``--rounds``
   rounds, alternated; median of each side, its range, and the median of the per-round ratios.

Targets: overhead p50 <= 5 ms; concurrent tokens/s >= 0.9x the rollout batch's.

    python bench/gateway.py              # ~1-2 min on 2 cores; writes the `gateway` section
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import busy_cores_before, compose, other_load_text, training_machine, write_section  # noqa: E402

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
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise SystemExit("bench/gateway.py: the gateway did not start on 127.0.0.1")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def gateway_for(engine, tokenizer, window_s: float, rows: int, new_tokens: int):
    from rl.rollout.gateway.service import Gateway
    from rl.rollout.gateway.settings import GatewaySettings

    settings = GatewaySettings(model_name=MODEL, context_tokens=engine.model.config.max_position_embeddings,
                               max_tokens=new_tokens, max_n=1, batch_window_s=window_s, max_batch_rows=rows,
                               open_access=True, seed=0)  # fmt: skip
    return Gateway(engine, tokenizer, settings)


def messages(i: int) -> list[dict]:
    """The ``i``-th program's conversation: a GuessNumber-like exchange of a few turns."""
    turns = [{"role": "user", "content": "guess a number in 0-99"}]
    for k in range(i % 3):
        turns += [{"role": "assistant", "content": str(50 + k)}, {"role": "user", "content": "too high"}]
    return turns


async def chat(client, i: int, new_tokens: int) -> int:
    response = await client.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=new_tokens)
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


def concurrent(engine, tokenizer, clients: int, rounds: int, new_tokens: int, window_s: float) -> dict:
    """Tokens/s of ``clients`` concurrent programs and of one rollout batch of the same prompts."""
    import torch
    from openai import AsyncOpenAI

    from rl.rollout.gateway.bodies import chat_request
    from rl.rollout.gateway.chat_format import render_chat

    prompts = [render_chat(chat_request({"model": MODEL, "messages": messages(i)}, clients).messages, None,
                           tokenizer) for i in range(clients)]  # fmt: skip
    gateway = gateway_for(engine, tokenizer, window_s, clients, new_tokens)
    rates: dict[str, list[float]] = {"gateway": [], "engine": []}
    batches: list[int] = []
    with Served(gateway) as url:

        async def one_round() -> tuple[int, float]:
            programs = [AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=300)
                        for _ in range(clients)]  # fmt: skip
            start = time.perf_counter()
            tokens = await asyncio.gather(*(chat(c, i, new_tokens) for i, c in enumerate(programs)))
            wall = time.perf_counter() - start
            await asyncio.gather(*(c.close() for c in programs))
            return sum(tokens), wall

        def engine_round(seed: int) -> tuple[int, float]:
            start = time.perf_counter()
            generations = engine.generate(prompts, new_tokens, torch.Generator().manual_seed(seed))
            return sum(len(g.token_ids) for g in generations), time.perf_counter() - start

        asyncio.run(one_round())  # warm-up of both sides, uncounted
        engine_round(10_000)
        for r in range(rounds):
            for side in ("gateway", "engine") if r % 2 == 0 else ("engine", "gateway"):
                if side == "gateway":
                    seen = len(gateway.batcher.batch_sizes)
                    tokens, wall = asyncio.run(one_round())
                    batches += list(gateway.batcher.batch_sizes)[seen:]
                else:
                    tokens, wall = engine_round(r)
                rates[side].append(tokens / wall)
    ratios = [g / e for g, e in zip(rates["gateway"], rates["engine"], strict=True)]
    return {"rates": rates, "ratios": ratios, "batches": batches}


def spread(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40, help="sequential calls of the overhead part")
    ap.add_argument("--clients", type=int, default=64, help="concurrent agent programs")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the concurrent part (each side)")
    ap.add_argument("--new-tokens", type=int, default=16, help="max_tokens of every call")
    ap.add_argument("--window-ms", type=float, default=5.0, help="the batcher's window, concurrent part")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    for name in ("calls", "clients", "rounds", "new_tokens"):
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
    conc = concurrent(engine, tokenizer, args.clients, args.rounds, args.new_tokens, args.window_ms / 1000)
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
        "process, "
        f"clients the `openai` SDK (async), each call a chat completion of at most {args.new_tokens} tokens.",
        "",
        "| | figure |",
        "|---|---|",
        f"| overhead per call over the engine alone, {len(extra)} sequential calls (p50 / p90) | "
        f"{p50:.2f} ms / {p90:.2f} ms |",
        f"| {args.clients} concurrent programs, generated tokens/s (median, min-max of {args.rounds} rounds) "
        f"| {spread(conc['rates']['gateway'])} |",
        f"| the same {args.clients} prompts as one rollout batch (`engine.generate`) | "
        f"{spread(conc['rates']['engine'])} |",
        f"| ratio, median of the rounds' pairs (min-max) | {spread(conc['ratios'], '.2f')}x |",
        f"| the batcher's engine calls per round, rows each (window {args.window_ms:g} ms) | "
        f"{len(batches) / args.rounds:.1f} calls, rows {spread([float(b) for b in batches], '.0f')} |",
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
