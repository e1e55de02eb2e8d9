"""One agent program of `bench/gateway.py`'s concurrent part, in a process of its own as in training: per
line ``go`` on stdin it plays its turns (one chat completion each, sent as soon as the last one answered)
and prints one JSON line: the tokens generated, and the first send and the last answer on the
``time.monotonic`` clock (the same clock in every process of the host). CLIENT: ``openai`` (the SDK,
async) or ``stdlib`` (the shipped example agent's client, `agentenv.tasks.programs.guess_agent.post`).

    python bench/gateway_program.py URL MODEL INDEX TURNS MAX_TOKENS CLIENT
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def messages(i: int, turn: int) -> list[dict]:
    """The ``i``-th program's conversation at ``turn``: a GuessNumber-like exchange of a few turns (fixed
    text, so that the rollout side of the bench can sample the very same prompts)."""
    turns = [{"role": "user", "content": "guess a number in 0-99"}]
    for k in range(i % 3 + turn):
        turns += [{"role": "assistant", "content": str(50 + k)}, {"role": "user", "content": "too high"}]
    return turns


def play_openai(url: str, model: str, i: int, turns: int, max_tokens: int) -> None:
    from openai import AsyncOpenAI

    async def play(client) -> dict:
        began, tokens = time.monotonic(), 0
        for turn in range(turns):
            response = await client.chat.completions.create(model=model, messages=messages(i, turn),
                                                            max_tokens=max_tokens)  # fmt: skip
            tokens += response.usage.completion_tokens
        return {"tokens": tokens, "began": began, "ended": time.monotonic()}

    async def serve() -> None:
        client = AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=300)
        print(json.dumps({"ready": True}), flush=True)
        while (await asyncio.to_thread(sys.stdin.readline)).strip() == "go":
            print(json.dumps(await play(client)), flush=True)
        await client.close()

    asyncio.run(serve())


def play_stdlib(url: str, model: str, i: int, turns: int, max_tokens: int) -> None:
    from agentenv.tasks.programs.guess_agent import post

    def call(turn: int) -> int:
        body = {"model": model, "messages": messages(i, turn), "max_tokens": max_tokens}
        status, data = post(f"{url}/chat/completions", body, "bench")
        if status != 200:
            sys.exit(f"the gateway answered {status}: {data[:500]!r}")
        return json.loads(data)["usage"]["completion_tokens"]

    print(json.dumps({"ready": True}), flush=True)
    while sys.stdin.readline().strip() == "go":
        began = time.monotonic()
        tokens = sum(call(turn) for turn in range(turns))
        print(json.dumps({"tokens": tokens, "began": began, "ended": time.monotonic()}), flush=True)


def main() -> None:
    url, model, client = sys.argv[1], sys.argv[2], sys.argv[6]
    i, turns, max_tokens = map(int, sys.argv[3:6])
    {"openai": play_openai, "stdlib": play_stdlib}[client](url, model, i, turns, max_tokens)


if __name__ == "__main__":
    main()
