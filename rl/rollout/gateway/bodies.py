"""Checking the JSON bodies of the OpenAI endpoints into typed requests.

Every refusal is an `ApiError` (400) whose ``param`` names the field at fault, e.g.
``messages[1].role``.
Fields of OpenAI's API that change nothing here (``user``, ``seed`` ...) are accepted and ignored;
the ones the gateway cannot honour (``top_logprobs`` > 0, ``echo``) are refused by name.
A temperature of 0 asks for greedy decoding: it samples at `GREEDY_TEMPERATURE`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rl.rollout.gateway.chat_format import Message, ToolCall
from rl.rollout.gateway.errors import ApiError

GREEDY_TEMPERATURE = 1e-4  # what temperature=0 samples at: the arg-max but for exact ties
MAX_STOP_SEQUENCES = 4  # as OpenAI's API
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class SamplingRequest:
    """The sampling fields common to both endpoints."""

    model: str
    temperature: float
    top_p: float
    max_tokens: int | None  # None: up to the gateway's limit
    stop: tuple[str, ...]
    n: int
    logprobs: bool
    stream: bool
    include_usage: bool = False  # a stream ends with a chunk of the call's usage (``stream_options``)


@dataclass(frozen=True)
class ChatRequest:
    sampling: SamplingRequest
    messages: list[Message]
    tools: list[dict] | None


@dataclass(frozen=True)
class CompletionRequest:
    sampling: SamplingRequest
    prompts: list[str | list[int]]  # text, or token ids given as they are


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(f"{name} must be a number from {low} to {high}, got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ApiError(f"{name} must be an integer {bound}, got {value!r}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise ApiError(f"stop must be a non-empty string or a list of up to {MAX_STOP_SEQUENCES}", "stop")
    return tuple(stops)


def _sampling(body: Any, max_n: int, logprobs: bool, max_tokens_field: str) -> SamplingRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("model is required: the name of the served policy (GET /v1/models)", "model")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    stream = _flag(body, "stream")
    return SamplingRequest(
        model=model,
        temperature=temperature or GREEDY_TEMPERATURE,
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or GREEDY_TEMPERATURE,
        max_tokens=_integer(body, max_tokens_field, 1),
        stop=_stop(body),
        n=_integer(body, "n", 1, max_n) or 1,
        logprobs=logprobs,
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


def _stream_options(body: dict, stream: bool) -> bool:
    """``stream_options``' ``include_usage``; as OpenAI's, the options are refused without ``stream``."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise ApiError(f"stream_options must be an object, got {options!r}", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise ApiError(f"stream_options.include_usage must be true or false, got {include!r}",
                       "stream_options.include_usage")  # fmt: skip
    return bool(include)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _text(content: Any, param: str, allow_none: bool) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ApiError(f"{param}[{i}] must be a text part {{type: text, text: ...}}", f"{param}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"{param} must be a string or a list of text parts", param)


def _tool_calls(calls: Any, param: str) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise ApiError(f"{param} must be a list", param)
    parsed = []
    for i, call in enumerate(calls):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(f"{where} must be {{type: function, function: {{name, arguments}}}}", where)
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = None
        if not isinstance(arguments, dict):
            raise ApiError(
                f"{where}.function.arguments must be a JSON object's text", f"{where}.function.arguments"
            )
        parsed.append(ToolCall(str(call.get("id", "")), function["name"], json.dumps(arguments)))
    return tuple(parsed)


def _messages(body: dict) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content}", "messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        calls = _tool_calls(message.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
        content = _text(message.get("content"), f"{where}.content", allow_none=role == "assistant")
        parsed.append(Message("system" if role == "developer" else role, content, calls))
    return parsed


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list):
        raise ApiError("tools must be a list of {type: function, function: {...}}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}", f"tools[{i}]")
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise ApiError(f"tool_choice {choice!r} is not supported (auto or none)", "tool_choice")
    return tools


def chat_request(body: Any, max_n: int) -> ChatRequest:
    """A ``POST /v1/chat/completions`` body, checked."""
    body = _object(body)
    if _integer(body, "top_logprobs", 0):
        raise ApiError(
            "top_logprobs > 0 is not supported: logprobs gives each sampled token's", "top_logprobs"
        )
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = _sampling(body, max_n, _flag(body, "logprobs"), field)
    return ChatRequest(sampling, _messages(body), _tools(body))


def completion_request(body: Any, max_n: int) -> CompletionRequest:
    """A ``POST /v1/completions`` body, checked."""
    body = _object(body)
    _integer(body, "logprobs", 0, 0)  # 0: each sampled token's log-prob (no alternatives)
    if _flag(body, "echo"):
        raise ApiError("echo is not supported", "echo")
    sampling = _sampling(body, max_n, body.get("logprobs") is not None, "max_tokens")
    if sampling.max_tokens is None:  # OpenAI's default for this endpoint
        sampling = SamplingRequest(**{**sampling.__dict__, "max_tokens": 16})
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p)) for p in prompt
        )
    ):
        prompts = list(prompt)
    else:
        raise ApiError("prompt must be a string, a list of strings, or token ids", "prompt")
    return CompletionRequest(sampling, prompts)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
