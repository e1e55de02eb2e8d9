"""The openai SDK inside a sandbox of the `agent` image (sandbox_images/agent/) calling the gateway through
`rl.rollout.gateway.sandbox_link.SandboxLink`: ``OpenAI()`` reads OPENAI_BASE_URL / OPENAI_API_KEY from the
environment the link gives; its chats (plain, streamed, with tools) are recorded under the episode's key,
``models.list()`` names the served policy, and a refused call is the SDK's own exception with OpenAI's
error body. The image is built once per module (a content-hash tag: later runs reuse it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from gateway_testutil import MODEL, TOK, tiny_gateway
from rl_testutil import compose

from agentenv import Sandbox, SandboxConfig
from agentenv.backend import images
from rl.rollout.gateway.chat_format import parse_completion
from rl.rollout.gateway.sandbox_link import SandboxLink

ROOT = Path(__file__).resolve().parents[2]

# sdk_client.py MODE MODEL: the openai SDK as an agent program uses it, configured by the environment
# alone. Prints one JSON object: what each call returned (or raised).
CLIENT = r"""
import json, sys
import openai
from openai import OpenAI

mode, model = sys.argv[1], sys.argv[2]
client = OpenAI(max_retries=0, timeout=60)
out = {"sdk": openai.__version__}
if mode == "chats":
    out["models"] = [m.id for m in client.models.list()]
    hello = [{"role": "user", "content": "plain hello"}]
    reply = client.chat.completions.create(model=model, messages=hello, max_tokens=6, temperature=0)
    out["plain"] = {"type": type(reply).__name__, "content": reply.choices[0].message.content,
                    "finish": reply.choices[0].finish_reason, "usage": reply.usage.model_dump()}
    stream = client.chat.completions.create(model=model, messages=hello, max_tokens=6, temperature=0,
                                            stream=True)
    chunks = list(stream)
    out["streamed"] = {"chunks": len(chunks),
                       "content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                       "finish": [c.choices[0].finish_reason for c in chunks if c.choices][-1]}
    tools = [{"type": "function", "function": {"name": "ls", "description": "list a folder",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "what is in /srv?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "ls", "arguments": json.dumps({"path": "/srv"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "notes.txt"},
    ]
    reply = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=6)
    message = reply.choices[0].message
    out["tools"] = {"finish": reply.choices[0].finish_reason,
                    "tool_calls": [c.model_dump() for c in message.tool_calls or []]}
elif mode == "unknown-model":
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    except openai.APIStatusError as e:
        out["error"] = {"class": type(e).__name__, "status": e.status_code, "body": e.body}
print(json.dumps(out))
"""

# agent_episode.py MODEL TASK: one episode of an agent of OpenAI's agent framework (openai-agents, as it
# comes from PyPI) with one tool, on the chat completions API of OPENAI_BASE_URL. Prints how many model
# calls the run made and its final output.
EPISODE = r"""
import json, os, sys
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_tracing_disabled

set_tracing_disabled(True)  # the traces would go to api.openai.com
set_default_openai_api("chat_completions")


@function_tool
def list_files(path: str) -> str:
    '''The names of the files in a folder.'''
    return "\n".join(sorted(os.listdir(path)))


agent = Agent(name="helper", instructions="Be brief.", model=sys.argv[1], tools=[list_files],
              model_settings=ModelSettings(max_tokens=6))
result = Runner.run_sync(agent, sys.argv[2], max_turns=4)
print(json.dumps({"calls": len(result.raw_responses), "output": result.final_output}))
"""


@pytest.fixture(scope="module")
def agent_image(task_home) -> str:
    """The `agent` image's tag, built here unless this recipe's tag exists already."""
    return images.build("agent", quiet=True).tag


@pytest.fixture(scope="module")
def link():
    with SandboxLink(tiny_gateway(compose().model, max_tokens=6)) as running:
        yield running


@pytest.fixture(scope="module")
def sandbox(agent_image, sandbox_config, link):
    sb = Sandbox.create(config=SandboxConfig.from_dict({**sandbox_config, "image": "agent"}))
    try:
        sb.write_file("sdk_client.py", CLIENT)
        sb.write_file("agent_episode.py", EPISODE)
        yield sb
    finally:
        link.detach(sb)
        sb.close()


def run_client(link: SandboxLink, sb: Sandbox, key: str, mode: str, model: str = MODEL) -> dict:
    result = sb.exec(["python3", "sdk_client.py", mode, model], env=link.env(sb, key), timeout=120)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def prompt_texts(link: SandboxLink, key: str) -> tuple[list[str], list]:
    calls = link.gateway.keys.close(key).calls
    return [TOK.decode(c.prompt_ids) for c in calls], calls


@pytest.mark.docker
@pytest.mark.usefixtures("one_torch_thread")
def test_the_sdk_in_the_sandbox_chats_streams_and_uses_tools_under_the_episode_key(link, sandbox):
    key = link.gateway.keys.open()
    out = run_client(link, sandbox, key, "chats")
    assert out["sdk"] == pinned()["openai"]
    assert out["models"] == [MODEL]
    plain, streamed = out["plain"], out["streamed"]
    assert plain["type"] == "ChatCompletion" and plain["finish"] in ("stop", "length")
    # greedy both times: the streamed deltas make up the text the plain call returned
    assert streamed["chunks"] >= 2 and streamed["content"] == plain["content"]
    assert streamed["finish"] == plain["finish"]
    assert out["tools"]["finish"] in ("stop", "length", "tool_calls")
    for call in out["tools"]["tool_calls"]:  # a tool call the policy sampled arrives as the SDK's type
        assert call["type"] == "function" and call["function"]["name"]
    texts, calls = prompt_texts(link, key)
    assert len(calls) == 3  # every chat, under this episode's key (models.list samples nothing)
    assert "plain hello" in texts[0] and texts[1] == texts[0]
    assert plain["usage"]["prompt_tokens"] == len(calls[0].prompt_ids)
    assert plain["usage"]["completion_tokens"] == len(calls[0].completion_ids) >= 1
    # the tools, the assistant's call and the tool's answer all reached the policy's prompt
    assert '"name": "ls"' in texts[2] and '"path": "/srv"' in texts[2] and "notes.txt" in texts[2]
    assert "what is in /srv?" in texts[2]


@pytest.mark.docker
@pytest.mark.usefixtures("one_torch_thread")
def test_an_unknown_model_is_the_sdks_own_error_with_openais_body(link, sandbox):
    key = link.gateway.keys.open()
    error = run_client(link, sandbox, key, "unknown-model", "gpt-nonexistent")["error"]
    assert error["class"] == "BadRequestError" and error["status"] == 400
    body = error["body"]
    assert set(body) == {"message", "type", "param", "code"}, body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "gpt-nonexistent" in body["message"] and MODEL in body["message"]
    assert link.gateway.keys.close(key).calls == []  # refused before sampling: nothing recorded


@pytest.mark.docker
@pytest.mark.usefixtures("one_torch_thread")
def test_episodes_of_an_unmodified_agent_framework_are_captured_call_by_call(link, sandbox):
    for episode in range(2):
        key = link.gateway.keys.open()
        task = f"episode {episode}: what is in /workspace?"
        result = sandbox.exec(["python3", "agent_episode.py", MODEL, task], env=link.env(sandbox, key),
                              timeout=120)
        assert result.exit_code == 0, result.stderr
        run = json.loads(result.stdout)
        texts, calls = prompt_texts(link, key)
        assert len(calls) == run["calls"] >= 1  # every model call of the run, under its episode's key
        assert all(task in text and "Be brief." in text and '"name": "list_files"' in text for text in texts)
        if run["calls"] == 1:  # no tool call: the agent's answer is the text of the tokens captured
            assert run["output"] == parse_completion(TOK.decode(calls[0].completion_ids))[0]


def pinned() -> dict[str, str]:
    """name -> version of the `agent` image's requirements.txt, but for the lines that say why they differ
    from the lock."""
    text = (ROOT / "sandbox_images" / "agent" / "requirements.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)(?!.*differs from the lock)", text, re.MULTILINE))


def test_the_agent_image_pins_the_versions_of_the_lock():
    """A package both pin is at the lock's version in the image, unless its line says why not."""
    lock = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "requirements.lock").read_text(),
                           re.MULTILINE))
    image = pinned()
    assert {"openai", "openai-agents"} <= set(image)
    differing = {name: (pin, lock[name]) for name, pin in image.items() if name in lock and lock[name] != pin}
    assert differing == {}, "requirements.txt's version, the lock's"
