"""The chat format of the K3 policy: OpenAI chat messages to prompt token ids, and a completion's text
back to an assistant message with ``tool_calls``.

The layout is the trainer's episode layout (`rl.tokenizer`): ``<|bos|>``, then one turn per message,
every non-assistant message an observation turn ``<|observation|> text <|end|>`` and every assistant
message an action turn ``<|action|> text <|end|>``; the prompt ends with ``<|action|>``, which the policy
answers with its text and ``<|end|>``. The text of each turn:

- user: its content as it is; system: ``<system>\\n{content}\\n</system>``;
- tool (a tool's result): ``<tool_response>\\n{content}\\n</tool_response>``;
- ``tools`` of the request: a first observation turn ``<tools>`` (one JSON object per line, as the request
  gave them) ``</tools>`` followed by `TOOL_INSTRUCTION`;
- assistant: its content, then each tool call on a line of its own,
  ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``.

A completion's text is parsed the same way (`parse_completion`): every ``<tool_call>`` line holding a
JSON object with a string ``name`` (and an object ``arguments``) becomes a tool call; the rest is the
content. Rendering that message back gives the sampled text again when the policy wrote the calls as
``json.dumps`` does, so the next prompt extends the recorded tokens (`rl.rollout.gateway.samples`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from rl.tokenizer import Tokenizer

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_INSTRUCTION = (
    f'To call a tool, write a line {TOOL_CALL_OPEN}{{"name": NAME, "arguments": {{...}}}}{TOOL_CALL_CLOSE}'
)
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI's ``function.arguments``


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant or tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()


def call_text(call: ToolCall) -> str:
    """One tool call as the policy writes it."""
    payload = {"name": call.name, "arguments": json.loads(call.arguments)}
    return f"{TOOL_CALL_OPEN}{json.dumps(payload)}{TOOL_CALL_CLOSE}"


def turn_text(message: Message) -> str:
    """The text of one message's turn (module docstring)."""
    if message.role == "system":
        return f"<system>\n{message.content}\n</system>"
    if message.role == "tool":
        return f"<tool_response>\n{message.content}\n</tool_response>"
    if message.role == "assistant":
        return "\n".join(
            [message.content] * bool(message.content) + [call_text(c) for c in message.tool_calls]
        )
    return message.content


def tools_text(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(tool) for tool in tools)
    return f"<tools>\n{lines}\n</tools>\n{TOOL_INSTRUCTION}"


def render_chat(messages: list[Message], tools: list[dict] | None, tokenizer: Tokenizer) -> list[int]:
    """The prompt token ids of a chat request, ending with the turn the policy is to write."""
    tok = tokenizer
    ids = [tok.bos_id]
    if tools:
        ids += [tok.observation_id, *tok.encode(tools_text(tools)), tok.end_id]
    for message in messages:
        opener = tok.action_id if message.role == "assistant" else tok.observation_id
        ids += [opener, *tok.encode(turn_text(message)), tok.end_id]
    return ids + [tok.action_id]


def parse_completion(text: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a completion's text (module docstring)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            continue
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", payload["name"], json.dumps(arguments)))
    kept.append(text[position:])
    content = "".join(kept)
    return (content.rstrip("\n") if calls else content), calls
