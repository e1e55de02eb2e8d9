"""The OpenAI-compatible HTTP API of a `Gateway` (FastAPI, served by uvicorn).

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models[/{id}]``. With ``stream``, the
reply is server-sent events in OpenAI's chunk shapes, sent as the tokens are sampled: for a chat a
``role`` chunk of each choice first, then its content deltas (with their tokens' log-probs when asked),
its tool calls once it is done, a chunk with its ``finish_reason``, and ``data: [DONE]`` at the end; a
failure after the stream began is an ``error`` event in OpenAI's error body.
The API key (``Authorization: Bearer KEY``) names the episode a call is recorded against. Every error,
a bad request or a failure of the engine, has OpenAI's error body; none shows a traceback.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from rl.rollout.gateway.bodies import chat_request, completion_request
from rl.rollout.gateway.errors import ApiError, unknown_model
from rl.rollout.gateway.service import Choice, Delta, Gateway
from rl.tokenizer import Tokenizer


def _token_logprobs(ids: list[int], logprobs: list[float], tokenizer: Tokenizer) -> list[tuple[str, float]]:
    """(text, log-prob) of each sampled token but the end of turn (never shown)."""
    pairs = zip(ids, logprobs, strict=True)
    return [(tokenizer.decode([t]), lp) for t, lp in pairs if t != tokenizer.end_id]


def _chat_logprobs(ids: list[int], logprobs: list[float], tokenizer: Tokenizer) -> dict:
    return {
        "content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in _token_logprobs(ids, logprobs, tokenizer)
        ]
    }


def _completion_logprobs(
    ids: list[int], logprobs: list[float], tokenizer: Tokenizer, offset: int = 0
) -> dict:
    """``offset``: where the first token's text starts in the choice's text (a streamed chunk's)."""
    pairs = _token_logprobs(ids, logprobs, tokenizer)
    offsets = [offset + sum(len(t) for t, _ in pairs[:i]) for i in range(len(pairs))]
    return {
        "tokens": [t for t, _ in pairs],
        "token_logprobs": [lp for _, lp in pairs],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _tool_calls(choice: Choice) -> list[dict]:
    return [
        {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(choice.tool_calls)
    ]


def _usage(choices: list[Choice], n: int) -> dict:
    prompt = sum(c.prompt_tokens for c in choices[::n])  # choices come n by n for each prompt
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events of ``events``, ``[DONE]`` at the end, or an error event where they fail."""
    try:
        async for body in events:
            yield _event(body)
    except ApiError as exc:
        yield _event(exc.body())
        return
    except Exception as exc:  # the stream has begun: the failure is told in the stream, as OpenAI does
        yield _event(_server_error(exc).body())
        return
    yield "data: [DONE]\n\n"


def _server_error(exc: Exception) -> ApiError:
    return ApiError(f"the policy failed: {type(exc).__name__}: {exc}", status=500, type="server_error")


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


async def _body(request: Request):
    try:
        return await request.json()
    except ValueError:
        raise ApiError("the request body is not valid JSON") from None


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app serving ``gateway`` (its batcher runs while the app does)."""
    tok, name = gateway.tokenizer, gateway.settings.model_name

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        gateway.batcher.start()
        try:
            yield
        finally:
            await gateway.batcher.stop()

    app = FastAPI(title="k3rl policy gateway", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return ApiError(str(exc.detail), status=exc.status_code).response()

    @app.exception_handler(Exception)
    async def server_error(_request: Request, exc: Exception) -> Response:
        return _server_error(exc).response()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "k3rl"}]}
        )

    @app.get("/v1/models/{model}")
    async def model(model: str) -> JSONResponse:
        if model != name:
            raise unknown_model(model, name, status=404)
        return JSONResponse({"id": name, "object": "model", "created": 0, "owned_by": "k3rl"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        key = gateway.authorize(_bearer(request))
        req = chat_request(await _body(request), gateway.settings.max_n)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}

        def logprobs(ids: list[int], lps: list[float]) -> dict | None:
            return _chat_logprobs(ids, lps, tok) if req.sampling.logprobs else None

        if req.sampling.stream:
            done: list[Choice] = []
            n = req.sampling.n
            chunks = _chat_chunks(_finished(gateway.stream_chat(req, key), done), n, head, logprobs)
            if req.sampling.include_usage:
                chunks = _with_usage(chunks, done, n, {**head, "object": "chat.completion.chunk"})
            return _streaming(chunks)
        choices = await gateway.chat(req, key)

        def message(choice: Choice) -> dict:
            body = {"role": "assistant", "content": choice.text}
            if choice.tool_calls:
                body["tool_calls"] = _tool_calls(choice)
            return body

        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "usage": _usage(choices, req.sampling.n),
                "choices": [
                    {
                        "index": c.index,
                        "message": message(c),
                        "logprobs": logprobs(c.token_ids, c.logprobs),
                        "finish_reason": c.finish_reason,
                    }
                    for c in choices
                ],
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        key = gateway.authorize(_bearer(request))
        req = completion_request(await _body(request), gateway.settings.max_n)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
        }

        def logprobs(ids: list[int], lps: list[float], offset: int = 0) -> dict | None:
            return _completion_logprobs(ids, lps, tok, offset) if req.sampling.logprobs else None

        if req.sampling.stream:
            done = []
            chunks = _completion_chunks(_finished(gateway.stream_completions(req, key), done), head, logprobs)
            if req.sampling.include_usage:
                chunks = _with_usage(chunks, done, req.sampling.n, head)
            return _streaming(chunks)
        choices = await gateway.complete(req, key)
        return JSONResponse(
            {
                **head,
                "usage": _usage(choices, req.sampling.n),
                "choices": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": logprobs(c.token_ids, c.logprobs),
                        "finish_reason": c.finish_reason,
                    }
                    for c in choices
                ],
            }
        )

    return app


def _streaming(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(_sse(chunks), media_type="text/event-stream")


async def _chat_chunks(
    stream: AsyncIterator[Delta | Choice], n: int, head: dict, logprobs: Callable
) -> AsyncIterator[dict]:
    """A streamed chat's chunks: each choice's role, content deltas, tool calls and finish reason."""
    chunk = {**head, "object": "chat.completion.chunk"}

    def one(index: int, delta: dict, finish: str | None = None, lps: dict | None = None) -> dict:
        return {
            **chunk,
            "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}],
        }

    for index in range(n):
        yield one(index, {"role": "assistant", "content": ""})
    async for item in stream:
        if isinstance(item, Delta):
            yield one(item.index, {"content": item.text}, lps=logprobs(item.token_ids, item.logprobs))
            continue
        if item.tool_calls:
            yield one(item.index, {"tool_calls": _tool_calls(item)})
        yield one(item.index, {}, item.finish_reason)


Items = AsyncIterator[Delta | Choice]


async def _finished(stream: Items, done: list[Choice]) -> Items:
    """``stream`` as it is, keeping each finished choice in ``done``."""
    async for item in stream:
        if isinstance(item, Choice):
            done.append(item)
        yield item


async def _with_usage(
    chunks: AsyncIterator[dict], done: list[Choice], n: int, head: dict
) -> AsyncIterator[dict]:
    """With ``stream_options.include_usage``: each chunk with ``usage: null``, then one with no choices and
    the call's usage, as OpenAI sends them."""
    async for chunk in chunks:
        yield {**chunk, "usage": None}
    yield {**head, "choices": [], "usage": _usage(sorted(done, key=lambda c: c.index), n)}


async def _completion_chunks(
    stream: AsyncIterator[Delta | Choice], head: dict, logprobs: Callable
) -> AsyncIterator[dict]:
    """A streamed completion's chunks: each choice's text deltas, then its finish reason."""
    offsets: dict[int, int] = {}  # text sent of each choice so far

    def one(index: int, text: str, finish: str | None = None, lps: dict | None = None) -> dict:
        return {**head, "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish}]}

    async for item in stream:
        if isinstance(item, Delta):
            offset = offsets.get(item.index, 0)
            offsets[item.index] = offset + len(item.text)
            yield one(item.index, item.text, lps=logprobs(item.token_ids, item.logprobs, offset))
        else:
            yield one(item.index, "", item.finish_reason)
