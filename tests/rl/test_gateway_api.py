"""The gateway's OpenAI-compatible API, driven by the openai SDK over loopback with the tiny policy."""

import asyncio
import json

import httpx
import openai
import pytest
from gateway_testutil import MODEL, TOK, serving, tiny_gateway
from rl_testutil import compose

from rl.rollout.gateway.chat_format import Message, parse_completion, render_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served():
    gateway = tiny_gateway(compose().model)
    with serving(gateway) as url:
        key = gateway.keys.open()
        yield gateway, url, key


@pytest.fixture
def client(served):
    _gateway, url, key = served
    with openai.OpenAI(api_key=key, base_url=url, max_retries=0) as client:
        yield client


def test_models_lists_the_served_policy(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_an_unknown_model_is_a_400_naming_the_field_and_a_404_as_a_resource(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found"
    calls = [
        lambda: client.chat.completions.create(model="gpt-4o", messages=ONE),
        lambda: client.completions.create(model="gpt-4o", prompt="x", stream=True),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        error = caught.value.body
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert error["type"] == "invalid_request_error"
        assert "gpt-4o" in error["message"] and MODEL in error["message"]


def test_a_stream_with_include_usage_ends_with_the_calls_usage(client):
    asked = {"model": MODEL, "max_tokens": 5, "temperature": 0, "n": 2}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    chat = client.chat.completions
    chunks = list(chat.create(messages=ONE, **asked, **usage))
    assert all(c.usage is None and c.choices for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == chat.create(messages=ONE, **asked).usage  # greedy
    assert all(c.usage is None for c in chat.create(messages=ONE, stream=True, **asked))  # not asked: none
    whole = client.completions.create(prompt=["ab", "cde"], logprobs=0, **asked)
    done = list(client.completions.create(prompt=["ab", "cde"], **asked, **usage))
    assert done[-1].choices == [] and done[-1].usage == whole.usage
    assert whole.usage.prompt_tokens == 2 + 3


ONE = [{"role": "user", "content": "x"}]


def test_chat_completion_returns_the_sampled_tokens_with_their_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, logprobs=True
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens == len(render_chat([Message("user", "hi")], None, TOK))
    tokens = choice.logprobs.content
    assert "".join(t.token for t in tokens) == choice.message.content or any(
        "\ufffd" in t.token for t in tokens
    )  # a byte of a multi-byte character decodes alone as U+FFFD
    assert all(t.logprob <= 0 for t in tokens)


def test_n_gives_n_choices_each_cut_at_max_tokens(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=3, n=3, temperature=1.5
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)


def test_streaming_chat_and_completions_deliver_the_text_and_a_finish_reason(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, n=2
    )
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1}
    completions = list(client.completions.create(model=MODEL, prompt="ab", max_tokens=5, stream=True))
    reasons = [c.choices[0].finish_reason for c in completions]
    assert reasons[-1] in ("stop", "length") and not any(reasons[:-1])


def test_completions_take_text_or_token_ids_and_honour_max_tokens(client):
    reply = client.completions.create(model=MODEL, prompt=["abc", [97, 98]], max_tokens=4, logprobs=0, n=2)
    assert len(reply.choices) == 4
    assert reply.usage.prompt_tokens == 3 + 2
    for choice in reply.choices:
        assert len(choice.logprobs.token_logprobs) <= 4


def test_a_stop_sequence_cuts_the_completion_before_it(served, client):
    gateway, _url, _key = served
    # temperature 0: greedy, so the same prompt gives the same text; stop at its first character that is
    # new (past the first), so the cut text is exactly what comes before it
    free = client.completions.create(model=MODEL, prompt="xyz", max_tokens=10, temperature=0)
    text = free.choices[0].text
    at = next((i for i in range(1, len(text)) if text[i].strip() and text[i] not in text[:i]), None)
    assert at is not None, f"the seeded policy's greedy text {text!r} has no new character past its first"
    cut = client.completions.create(model=MODEL, prompt="xyz", max_tokens=10, temperature=0, stop=[text[at]])
    assert cut.choices[0].text == text[:at]
    assert cut.choices[0].finish_reason == "stop"




@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": ONE, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": MODEL, "messages": ONE, "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage"),  # fmt: skip
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
        ({"model": MODEL, "messages": ONE, "max_tokens": 10_000}, "max_tokens"),
        ({"model": MODEL, "messages": ONE, "temperature": 3}, "temperature"),
        ({"model": MODEL, "messages": ONE, "n": 99}, "n"),
    ],
)
def test_bad_chat_input_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    error = caught.value.body
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in error["message"]


def test_bad_completion_input_and_bad_json_are_400s(served):
    _gateway, url, key = served
    headers = {"Authorization": f"Bearer {key}"}
    long = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "y" * 500, "max_tokens": 16},
                      headers=headers)  # fmt: skip
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    ids = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": [1, 99999]}, headers=headers)
    assert ids.status_code == 400 and "99999" in ids.json()["error"]["message"]
    broken = httpx.post(f"{url}/chat/completions", content=b"{not json", headers=headers)
    assert broken.status_code == 400 and set(broken.json()["error"]) == {"message", "type", "param", "code"}


def test_a_key_that_is_no_open_episode_is_refused(served):
    _gateway, url, _key = served
    with openai.OpenAI(api_key="sk-someone-else", base_url=url, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="a", max_tokens=1)


def test_concurrent_calls_are_sampled_in_one_engine_call(served):
    gateway, url, key = served
    before = len(gateway.batcher.batch_sizes)

    async def calls():
        async with openai.AsyncOpenAI(api_key=key, base_url=url, max_retries=0) as client:
            return await asyncio.gather(*[
                client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=2) for i in range(4)
            ])  # fmt: skip

    replies = asyncio.run(calls())
    assert len(replies) == 4
    sizes = list(gateway.batcher.batch_sizes)[before:]
    assert sum(sizes) == 4 and len(sizes) < 4, sizes


def test_tool_calls_are_parsed_from_the_text_and_rendered_back_the_same():
    call = {"name": "search", "arguments": {"q": "k3", "n": 2}}
    text = f"let me look\n<tool_call>{json.dumps(call)}</tool_call>"
    content, calls = parse_completion(text)
    assert content == "let me look"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", call["arguments"])]
    message = Message("assistant", content, tuple(calls))
    rendered = render_chat([Message("user", "q"), message], None, TOK)
    assert TOK.decode(rendered).endswith("q" + text)
    assert parse_completion("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_a_chat_with_tools_returns_tool_calls_and_takes_them_back(served, client):
    gateway, _url, _key = served
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \"/\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a b"},
    ]  # fmt: skip
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = TOK.decode(render_chat([Message("user", "list")], tools, TOK))
    assert '"name": "ls"' in prompt and "<tool_call>" in prompt
    with pytest.raises(openai.BadRequestError) as caught:
        bad = [messages[0], {**messages[1], "tool_calls": [{"function": {"name": "ls", "arguments": "[1]"}}]}]
        client.chat.completions.create(model=MODEL, messages=bad, tools=tools)
    assert caught.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
