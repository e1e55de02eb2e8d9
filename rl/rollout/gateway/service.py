"""`Gateway`: the policy behind the OpenAI endpoints, apart from HTTP.

It renders a checked request into prompt token ids (`rl.rollout.gateway.chat_format` for chat, the tokenizer
or
the ids as given for completions), refuses a prompt the context cannot hold, samples ``n`` completions of
each prompt through the `Batcher`, cuts each at its first stop sequence, and records every completion
against the caller's episode key (`rl.rollout.gateway.capture`). A completion keeps the tokens up to the one
that
completed a stop sequence (the text returned ends before the sequence, as OpenAI's does). A streamed call
(`Gateway.stream_chat`, `Gateway.stream_completions`) yields each choice's text as it is sampled
(`Delta`, released by `rl.rollout.gateway.streaming.TextDeltas`), then the choice itself once it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from rl.rollout.gateway.batcher import Batcher
from rl.rollout.gateway.bodies import ChatRequest, CompletionRequest, SamplingRequest
from rl.rollout.gateway.capture import CallRecord, EpisodeKeys
from rl.rollout.gateway.chat_format import TOOL_CALL_OPEN, ToolCall, parse_completion, render_chat
from rl.rollout.gateway.errors import ApiError, unknown_model
from rl.rollout.gateway.settings import GatewaySettings
from rl.rollout.gateway.streaming import TextDeltas
from rl.rollout.torch_engine import Generation, Sampling
from rl.tokenizer import Tokenizer


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    token_ids: list[int]  # sampled, up to the end of the turn or the stop sequence
    logprobs: list[float]
    finish_reason: str  # stop, length or tool_calls
    tool_calls: list[ToolCall]
    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """Text of choice ``index`` released while it is sampled, with the tokens that released it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]


Finish = Callable[[int, list[int], Generation, int], Choice]  # (index, prompt, generation, version)


def cut_at_stop(ids: list[int], stops: tuple[str, ...], tokenizer: Tokenizer) -> tuple[int, str] | None:
    """(tokens kept, text before the stop) at the first token whose text completes a stop sequence."""
    if not stops:
        return None
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        found = [text.index(s) for s in stops if s in text]
        if found:
            return n, text[: min(found)]
    return None


class Gateway:
    def __init__(self, engine, tokenizer: Tokenizer, settings: GatewaySettings) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.keys = EpisodeKeys()
        self.batcher = Batcher(engine, settings.batch_window_s, settings.max_batch_rows, settings.seed)

    def authorize(self, key: str | None) -> str | None:
        """The episode key of a call (None: an open-access call, not recorded); 401 for any other."""
        if key and self.keys.known(key):
            return key
        if self.settings.open_access:
            return None
        raise ApiError("the API key is not the key of an open episode", status=401, code="invalid_api_key")

    def _limit(self, sampling: SamplingRequest, prompt: list[int], field: str) -> int:
        """The tokens a completion of ``prompt`` may sample; a 400 naming the field at fault."""
        cfg = self.settings
        if sampling.model != cfg.model_name:
            raise unknown_model(sampling.model, cfg.model_name)
        if sampling.max_tokens is not None and sampling.max_tokens > cfg.max_tokens:
            raise ApiError(f"max_tokens is at most {cfg.max_tokens}, got {sampling.max_tokens}", "max_tokens")
        room = cfg.context_tokens - len(prompt)
        wanted = sampling.max_tokens or min(cfg.max_tokens, room)
        if room < 1 or wanted > room:
            asked = f"max_tokens={wanted}" if room >= 1 else "at least one token"
            raise ApiError(
                f"the context holds {cfg.context_tokens} tokens; {field} take {len(prompt)} and the "
                f"completion asks for {asked}", field, code="context_length_exceeded",
            )  # fmt: skip
        return wanted

    def _rows(
        self, prompts: list[list[int]], sampling: SamplingRequest, limits: list[int]
    ) -> tuple[list[list[int]], list[Sampling]]:
        """The prompt and `Sampling` of each of the ``n`` completions of each prompt."""
        rows = [(p, limit) for p, limit in zip(prompts, limits, strict=True) for _ in range(sampling.n)]
        return [p for p, _ in rows], [
            Sampling(sampling.temperature, sampling.top_p, limit) for _, limit in rows
        ]

    async def _sample(
        self, prompts: list[list[int]], sampling: SamplingRequest, limits: list[int], finish: Finish
    ) -> list[Choice]:
        contexts, params = self._rows(prompts, sampling, limits)
        results = await self.batcher.generate(contexts, params)
        pairs = zip(contexts, results, strict=True)
        return [finish(i, p, gen, version) for i, (p, (gen, version)) in enumerate(pairs)]

    async def _stream(
        self, prompts: list[list[int]], sampling: SamplingRequest, limits: list[int], finish: Finish,
        hold: tuple[str, ...],
    ) -> AsyncIterator[Delta | Choice]:  # fmt: skip
        contexts, params = self._rows(prompts, sampling, limits)
        texts = [TextDeltas(self.tokenizer, sampling.stop, hold) for _ in contexts]
        events: asyncio.Queue[tuple[int, int, float] | None] = asyncio.Queue()

        def listener(index: int):
            return lambda token, logprob: events.put_nowait((index, token, logprob))

        listeners = [listener(i) for i in range(len(contexts))]
        sampled = asyncio.ensure_future(self.batcher.generate(contexts, params, listeners))
        sampled.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                index, token, logprob = event
                text, ids, logprobs = texts[index].push(token, logprob)
                if text:
                    yield Delta(index, text, ids, logprobs)
            results = sampled.result()
        finally:
            sampled.cancel()  # the client went away: its completions are not awaited (a no-op once done)
        for index, (prompt, (gen, version)) in enumerate(zip(contexts, results, strict=True)):
            choice = finish(index, prompt, gen, version)
            text, ids, logprobs = texts[index].rest(choice.text, choice.token_ids, choice.logprobs)
            if text or ids:
                yield Delta(index, text, ids, logprobs)
            yield choice

    def _finish(self, index: int, prompt: list[int], gen: Generation, version: int, stops, key) -> Choice:
        kept, text, ended = len(gen.token_ids), None, gen.ended
        cut = cut_at_stop(gen.token_ids, stops, self.tokenizer)
        if cut is not None:
            (kept, text), ended = cut, True
        ids = gen.token_ids[:kept]
        if text is None:
            text = self.tokenizer.decode(ids)
        if key is not None:
            routes = None if gen.routes is None else gen.routes[:kept]
            record = CallRecord(list(prompt), ids, gen.logprobs[:kept], version, routes, ended)
            self.keys.record(key, [record])
        reason = "stop" if ended else "length"
        return Choice(index, text, ids, gen.logprobs[:kept], reason, [], len(prompt))

    def _chat_prompt(self, request: ChatRequest) -> tuple[list[int], int]:
        prompt = render_chat(request.messages, request.tools, self.tokenizer)
        return prompt, self._limit(request.sampling, prompt, "messages")

    def _chat_finish(self, request: ChatRequest, key: str | None) -> Finish:
        def finish(index: int, prompt: list[int], gen: Generation, version: int) -> Choice:
            choice = self._finish(index, prompt, gen, version, request.sampling.stop, key)
            content, calls = parse_completion(choice.text) if request.tools else (choice.text, [])
            reason = "tool_calls" if calls else choice.finish_reason
            return Choice(index, content, choice.token_ids, choice.logprobs, reason, calls, len(prompt))

        return finish

    async def chat(self, request: ChatRequest, key: str | None) -> list[Choice]:
        prompt, limit = self._chat_prompt(request)
        return await self._sample([prompt], request.sampling, [limit], self._chat_finish(request, key))

    def stream_chat(self, request: ChatRequest, key: str | None) -> AsyncIterator[Delta | Choice]:
        """The chat's choices as they are sampled (a bad request raises here, before any is)."""
        prompt, limit = self._chat_prompt(request)
        hold = (TOOL_CALL_OPEN,) if request.tools else ()
        return self._stream([prompt], request.sampling, [limit], self._chat_finish(request, key), hold)

    def _completion_prompts(self, request: CompletionRequest) -> tuple[list[list[int]], list[int]]:
        vocab = self.tokenizer.vocab_size
        prompts = []
        for i, prompt in enumerate(request.prompts):
            if isinstance(prompt, str):
                prompts.append(self.tokenizer.encode(prompt))
                if not prompts[-1]:
                    raise ApiError(f"prompt[{i}] is empty", "prompt")
            elif max(prompt) >= vocab:
                raise ApiError(
                    f"prompt[{i}] holds token id {max(prompt)}; the vocabulary has {vocab}", "prompt"
                )
            else:
                prompts.append(list(prompt))
        return prompts, [self._limit(request.sampling, p, "prompt") for p in prompts]

    def _completion_finish(self, request: CompletionRequest, key: str | None) -> Finish:
        def finish(index: int, prompt: list[int], gen: Generation, version: int) -> Choice:
            return self._finish(index, prompt, gen, version, request.sampling.stop, key)

        return finish

    async def complete(self, request: CompletionRequest, key: str | None) -> list[Choice]:
        prompts, limits = self._completion_prompts(request)
        return await self._sample(prompts, request.sampling, limits, self._completion_finish(request, key))

    def stream_completions(
        self, request: CompletionRequest, key: str | None
    ) -> AsyncIterator[Delta | Choice]:
        """The completions' choices as they are sampled (a bad request raises here, before any is)."""
        prompts, limits = self._completion_prompts(request)
        return self._stream(prompts, request.sampling, limits, self._completion_finish(request, key), ())
