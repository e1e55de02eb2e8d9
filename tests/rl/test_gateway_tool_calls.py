"""A policy that writes a tool call gets OpenAI's ``tool_calls`` back. The tiny policy, taught one call by
optimizer steps on the chat-rendered prompt and that call, answers the chat with tools, plain and
streamed, with the call parsed out of its own text and ``finish_reason`` tool_calls."""

import json

import openai
import pytest
import torch
import torch.nn.functional as F
from gateway_testutil import MODEL, TOK, serving, settings
from rl_testutil import compose

from rl.policy import build_policy
from rl.rollout.gateway.bodies import chat_request
from rl.rollout.gateway.chat_format import render_chat
from rl.rollout.gateway.service import Gateway
from rl.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
ASKED = "ls /srv"
CALL = '<tool_call>{"name": "ls", "arguments": {"path": "/srv"}}</tool_call>'


def teach(model: torch.nn.Module, prompt: list[int], target: list[int], steps: int = 300) -> float:
    """AdamW steps on ``prompt + target`` (loss on the target tokens) until the model in eval mode, as the
    engine runs it, reads the target back as its argmax at every position; the last loss."""
    ids = torch.tensor([prompt + target])
    labels = ids[0, len(prompt) :]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        model.train()
        loss = F.cross_entropy(model(ids).logits[0, len(prompt) - 1 : -1].float(), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            greedy = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
        if (greedy == labels).all() and loss.item() < 0.05:
            break
    return loss.item()


@pytest.fixture(scope="module")
def client():
    model = build_policy(compose().model, seed=0).float()
    body = {"model": MODEL, "messages": [{"role": "user", "content": ASKED}], "tools": TOOLS}
    request = chat_request(body, 1)
    prompt = render_chat(request.messages, request.tools, TOK)  # as the gateway renders the call below
    loss = teach(model, prompt, [*TOK.encode(CALL), TOK.end_id])
    assert loss < 0.05, f"the tiny policy did not learn the call (loss {loss:.3f})"
    gateway = Gateway(TorchEngine(model, TOK), TOK, settings(open_access=True, max_tokens=96))
    with serving(gateway) as url, openai.OpenAI(api_key="k", base_url=url, max_retries=0) as client:
        yield client


def test_the_policys_own_tool_call_comes_back_as_tool_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASKED}],
                                           tools=TOOLS, temperature=0, max_tokens=96)  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "ls") and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"path": "/srv"}


def test_a_streamed_tool_call_arrives_once_with_its_finish_reason(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASKED}], tools=TOOLS, temperature=0, max_tokens=96,
        stream=True,
    ))  # fmt: skip
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "ls"
    assert json.loads(calls[0].function.arguments) == {"path": "/srv"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call's text is not streamed as content (it is held back until it parses as a call)
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks)
