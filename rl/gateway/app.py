"""The OpenAI-compatible HTTP API of a `Gateway` (FastAPI, served by uvicorn).

``POST /v1/chat/completions`` and ``POST /v1/completions`` (with ``stream``: server-sent events, one
chunk per choice once the batch that sampled it is done, then ``data: [DONE]``), ``GET /v1/models``.
The API key (``Authorization: Bearer KEY``) names the episode a call is recorded against. Every error,
a bad request or a failure of the engine, has OpenAI's error body; none shows a traceback.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from rl.gateway.bodies import chat_request, completion_request
from rl.gateway.errors import ApiError
from rl.gateway.service import Choice, Gateway
from rl.tokenizer import Tokenizer


def _token_logprobs(choice: Choice, tokenizer: Tokenizer) -> list[tuple[str, float]]:
    """(text, log-prob) of each sampled token but the end of turn (never shown)."""
    pairs = zip(choice.token_ids, choice.logprobs, strict=True)
    return [(tokenizer.decode([t]), lp) for t, lp in pairs if t != tokenizer.end_id]


def _chat_logprobs(choice: Choice, tokenizer: Tokenizer) -> dict:
    return {
        "content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in _token_logprobs(choice, tokenizer)
        ]
    }


def _completion_logprobs(choice: Choice, tokenizer: Tokenizer) -> dict:
    pairs = _token_logprobs(choice, tokenizer)
    offsets = [sum(len(t) for t, _ in pairs[:i]) for i in range(len(pairs))]
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


def _sse(chunks: list[dict]) -> Iterator[str]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


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
        return ApiError(
            f"the policy failed: {type(exc).__name__}: {exc}", status=500, type="server_error"
        ).response()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "k3rl"}]}
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        key = gateway.authorize(_bearer(request))
        req = chat_request(await _body(request), gateway.settings.max_n)
        choices = await gateway.chat(req, key)
        call_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": call_id, "created": created, "model": name}

        def message(choice: Choice) -> dict:
            body = {"role": "assistant", "content": choice.text}
            if choice.tool_calls:
                body["tool_calls"] = _tool_calls(choice)
            return body

        def logprobs(choice: Choice) -> dict | None:
            return _chat_logprobs(choice, tok) if req.sampling.logprobs else None

        if req.sampling.stream:
            chunk = {**head, "object": "chat.completion.chunk"}
            chunks = [
                {
                    **chunk,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": message(c),
                            "logprobs": logprobs(c),
                            "finish_reason": None,
                        }
                    ],
                }
                for c in choices
            ]
            chunks += [
                {**chunk, "choices": [{"index": c.index, "delta": {}, "finish_reason": c.finish_reason}]}
                for c in choices
            ]
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "usage": _usage(choices, req.sampling.n),
                "choices": [
                    {
                        "index": c.index,
                        "message": message(c),
                        "logprobs": logprobs(c),
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
        choices = await gateway.complete(req, key)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
        }

        def choice_body(c: Choice) -> dict:
            logprobs = _completion_logprobs(c, tok) if req.sampling.logprobs else None
            return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

        if req.sampling.stream:
            return StreamingResponse(
                _sse([{**head, "choices": [choice_body(c)]} for c in choices]), media_type="text/event-stream"
            )
        return JSONResponse(
            {**head, "usage": _usage(choices, req.sampling.n), "choices": [choice_body(c) for c in choices]}
        )

    return app
