"""Streaming (``stream: true``): the openai SDK gets the text token by token while the engine samples,
in OpenAI's chunk shapes, and the streamed pieces make up exactly the text of the same call without
streaming; `TextDeltas` holds back what a later token could still change."""

import asyncio
import json
import time

import openai
import pytest
from gateway_testutil import MODEL, TOK, serving, settings
from openai.types.chat import ChatCompletionChunk
from rl_testutil import compose

from rl.policy import build_policy
from rl.rollout.gateway.app import _chat_chunks
from rl.rollout.gateway.chat_format import TOOL_CALL_OPEN, ToolCall, parse_completion
from rl.rollout.gateway.service import Choice, Delta, Gateway
from rl.rollout.gateway.streaming import TextDeltas
from rl.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class TimedEngine(TorchEngine):
    """The tiny policy's engine, keeping when each ``generate`` returned."""

    def __init__(self, model) -> None:
        super().__init__(model, TOK)
        self.ended: list[float] = []

    def generate(self, *args, **kwargs):
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.ended.append(time.monotonic())


@pytest.fixture(scope="module")
def served():
    engine = TimedEngine(build_policy(compose().model, seed=0))
    with serving(Gateway(engine, TOK, settings(open_access=True))) as url:
        with openai.OpenAI(api_key="k", base_url=url, max_retries=0) as client:
            yield engine, client


HELLO = [{"role": "user", "content": "hello there"}]


def test_a_streamed_chat_arrives_token_by_token_and_makes_up_the_greedy_text(served):
    engine, client = served
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0,
                                           logprobs=True)  # fmt: skip
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0,
                                            logprobs=True, stream=True)  # fmt: skip
    chunks, arrived = [], []
    for chunk in stream:
        chunks.append(chunk)
        arrived.append(time.monotonic())
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [i for i, c in enumerate(chunks) if c.choices[0].delta.content]
    assert len(content) > 1 and content[-1] < len(chunks) - 1
    assert arrived[content[0]] < engine.ended[-1]  # the first piece came while the engine still sampled
    assert "".join(chunks[i].choices[0].delta.content for i in content) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [
        whole.choices[0].finish_reason
    ]
    streamed = [t for i in content for t in chunks[i].choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole.choices[0].logprobs.content]


def test_a_streamed_stop_and_completions_give_the_text_without_streaming(served):
    _engine, client = served
    free = client.completions.create(model=MODEL, prompt="xyz", max_tokens=16, temperature=0).choices[0].text
    # a two-character stop sequence that first occurs past the start of the greedy text
    at = next((i for i in range(2, len(free) - 1) if free[i : i + 2] not in free[: i + 1]), None)
    assert at is not None, f"the seeded policy's greedy text {free!r} has no new pair past its start"
    stop = free[at : at + 2]
    for stops in (None, [stop]):
        whole = client.completions.create(model=MODEL, prompt="xyz", max_tokens=16, temperature=0, stop=stops)
        chunks = list(client.completions.create(model=MODEL, prompt="xyz", max_tokens=16, temperature=0,
                                                stop=stops, stream=True))  # fmt: skip
        pieces = [c.choices[0].text for c in chunks if c.choices[0].text]
        assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.choices[0].text == free[: free.index(stop)]  # the stopped call, with its stop cut off


def test_held_back_text_waits_for_whole_characters_stop_sequences_and_tool_calls():
    def pieces(text: str, stops=(), hold=()) -> tuple[list[str], str]:
        deltas = TextDeltas(TOK, stops, hold)
        ids = TOK.encode(text)
        out = [deltas.push(t, -0.1)[0] for t in ids]
        return [p for p in out if p], deltas

    released, _ = pieces("é!")  # two bytes, then one
    assert released == ["é", "!"]
    released, deltas = pieces("an ENDx", stops=("END",))
    assert "".join(released) == "an " and deltas.stopped
    call = '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
    text = f"let me look\n{call}"
    released, deltas = pieces(text, hold=(TOOL_CALL_OPEN,))
    content, calls = parse_completion(text)
    assert "".join(released) == "let me look" and "<" not in "".join(released)
    assert deltas.rest(content, TOK.encode(text), [-0.1] * len(text))[0] == "" and len(calls) == 1


def test_a_streamed_tool_call_comes_as_openai_tool_call_chunks():
    call = ToolCall("call_1", "ls", json.dumps({"path": "/"}))
    done = Choice(0, "let me look", [1], [-0.1], "tool_calls", [call], 3)
    head = {"id": "chatcmpl-1", "created": 0, "model": MODEL}

    async def chunks():
        async def stream():
            yield Delta(0, "let me look", [1], [-0.1])
            yield done

        return [c async for c in _chat_chunks(stream(), 1, head, lambda ids, lps: None)]

    parsed = [ChatCompletionChunk.model_validate(c) for c in asyncio.run(chunks())]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "let me look"
    tool = parsed[2].choices[0].delta.tool_calls[0]
    assert (tool.index, tool.id, tool.type) == (0, "call_1", "function")
    assert (tool.function.name, tool.function.arguments) == ("ls", call.arguments)
    assert parsed[-1].choices[0].finish_reason == "tool_calls"
