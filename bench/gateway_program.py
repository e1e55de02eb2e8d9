"""One agent program of `bench/gateway.py`'s concurrent part, in a process of its own as in training: per
line ``go`` on stdin it plays its turns (one chat completion each, through the `openai` SDK, sent as soon
as the last one answered) and prints one JSON line: the tokens generated, and the first send and the last
answer on the ``time.monotonic`` clock (the same clock in every process of the host).

    python bench/gateway_program.py URL MODEL INDEX TURNS MAX_TOKENS
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


async def play(client, model: str, i: int, turns: int, max_tokens: int) -> dict:
    began, tokens = time.monotonic(), 0
    for turn in range(turns):
        response = await client.chat.completions.create(model=model, messages=messages(i, turn),
                                                        max_tokens=max_tokens)  # fmt: skip
        tokens += response.usage.completion_tokens
    return {"tokens": tokens, "began": began, "ended": time.monotonic()}


def main() -> None:
    from openai import AsyncOpenAI

    url, model, i, turns, max_tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])

    async def serve() -> None:
        client = AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=300)
        print(json.dumps({"ready": True}), flush=True)
        while (await asyncio.to_thread(sys.stdin.readline)).strip() == "go":
            print(json.dumps(await play(client, model, i, turns, max_tokens)), flush=True)
        await client.close()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
