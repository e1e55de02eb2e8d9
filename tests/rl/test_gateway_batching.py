"""The gateway's batcher: calls that arrive while the engine is busy, or in a burst while it is idle,
are sampled in one engine call, each with its own sampling and result, and one call's failure fails
only that call."""

import asyncio
import threading
import time

import openai
import pytest
import torch
from gateway_testutil import MODEL, TOK, serving, settings
from rl_testutil import compose

from rl.policy import build_policy
from rl.rollout.gateway.batcher import Batcher
from rl.rollout.gateway.service import Gateway
from rl.rollout.torch_engine import Sampling, TorchEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CountingEngine(TorchEngine):
    """The tiny policy's engine, keeping the rows of each ``generate`` (each engine round); while
    ``hold`` is set, a round waits for it to clear before it samples (a long batch, as the test needs)."""

    def __init__(self, model) -> None:
        super().__init__(model, TOK)
        self.rounds: list[int] = []
        self.hold: threading.Event | None = None

    def generate(self, contexts, *args, **kwargs):
        self.rounds.append(len(contexts))
        if self.hold is not None:
            assert self.hold.wait(30), "the test never let the held round go"
        return super().generate(contexts, *args, **kwargs)


@pytest.fixture(scope="module")
def engine():
    return CountingEngine(build_policy(compose().model, seed=0))


def wait_until(check, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_calls_arriving_while_a_batch_runs_go_in_one_round_with_their_own_results(engine):
    # window 0: a call is never held back to wait for others, yet those that queue behind a running
    # batch still share the next one
    gateway = Gateway(engine, TOK, settings(batch_window_s=0.0, open_access=True))
    prompts = [f"p{i} " * (1 + i % 3) for i in range(16)]
    limits = [4 + i % 5 for i in range(16)]  # each call's own max_tokens

    async def greedy(client, i):
        reply = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=limits[i],
                                                temperature=0, logprobs=0)  # fmt: skip
        return reply.choices[0]

    with serving(gateway) as url:

        async def together():
            async with openai.AsyncOpenAI(api_key="k", base_url=url, max_retries=0, timeout=60) as client:
                engine.hold = threading.Event()
                first = asyncio.create_task(greedy(client, 0))
                await asyncio.to_thread(wait_until, lambda: len(engine.rounds) == before + 1)
                calls = [asyncio.create_task(greedy(client, i)) for i in range(16)]
                await asyncio.to_thread(wait_until, lambda: gateway.batcher.waiting == 16)
                engine.hold.set()
                engine.hold = None
                await first
                return await asyncio.gather(*calls)

        async def alone():
            async with openai.AsyncOpenAI(api_key="k", base_url=url, max_retries=0, timeout=60) as client:
                return [await greedy(client, i) for i in range(16)]

        before = len(engine.rounds)
        batched = asyncio.run(together())
        rounds = engine.rounds[before + 1 :]
        one_by_one = asyncio.run(alone())
    assert len(rounds) <= 2 and sum(rounds) == 16, rounds
    for i, (b, a) in enumerate(zip(batched, one_by_one, strict=True)):
        assert len(b.logprobs.tokens) <= limits[i]
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason), i
        assert b.logprobs.tokens == a.logprobs.tokens, i


def test_a_burst_longer_than_the_window_is_one_round_while_the_engine_was_idle(engine):
    batcher = Batcher(engine, window_s=0.1, max_rows=16, seed=0)
    context = [TOK.bos_id, TOK.observation_id, *TOK.encode("go"), TOK.end_id, TOK.action_id]

    async def burst():
        batcher.start()
        try:
            calls = []
            for _ in range(12):  # 12 calls 25 ms apart: 275 ms, more than two windows
                calls.append(asyncio.create_task(batcher.generate([context], [Sampling(1.0, 1.0, 2)])))
                await asyncio.sleep(0.025)
            return await asyncio.gather(*calls)
        finally:
            await batcher.stop()

    before = len(engine.rounds)
    results = asyncio.run(burst())
    assert len(results) == 12 and engine.rounds[before:] == [12]


def test_a_failing_call_fails_alone_and_its_batch_mates_get_their_results(engine):
    batcher = Batcher(engine, window_s=0.05, max_rows=16, seed=0)
    good = [TOK.bos_id, TOK.observation_id, *TOK.encode("ok"), TOK.end_id, TOK.action_id]
    bad = [TOK.bos_id, engine.model.config.vocab_size + 5]  # an id the embedding does not have
    greedy = Sampling(1e-4, 1.0, 5)

    async def batch():
        batcher.start()
        try:
            return await asyncio.gather(*[batcher.generate([c], [greedy]) for c in (good, bad, good)],
                                        return_exceptions=True)  # fmt: skip
        finally:
            await batcher.stop()

    before = len(engine.rounds)
    first, failed, third = asyncio.run(batch())
    assert engine.rounds[before] == 3  # the three were one batch, which failed
    assert isinstance(failed, IndexError), failed
    expected = engine.generate([good], 5, torch.Generator().manual_seed(0), [greedy])[0]
    for result in (first, third):
        ((generation, version),) = result
        assert generation.token_ids == expected.token_ids and version == 0
