"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or server-sent events)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jax_kvcached.engine.engine import Prompt
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory.errors import ContextLengthExceeded, PoolExhausted
from jax_kvcached.serve.context import AppContext, ServedModel
from jax_kvcached.serve.loop import Finished, Overloaded, ServingLoop, Unavailable
from jax_kvcached.serve.protocol import (
    APIError,
    GenerationRequest,
    TextStream,
    parse_chat,
    parse_completion,
)


class _ClientGone(Exception):
    """The client disconnected before its response was complete."""


class _Generation:
    """One request's bridge from the loop thread's events to the asyncio side."""

    def __init__(self, loop: ServingLoop, aio: asyncio.AbstractEventLoop) -> None:
        self.loop, self.aio = loop, aio
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.handle: Any = None
        self.over = False

    def on_event(self, kind: str, value: Any) -> None:  # called in the loop thread
        self.aio.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        if not self.over and self.handle is not None:
            self.loop.cancel(self.handle)
        self.over = True


def prepare(ctx: AppContext, req: GenerationRequest) -> tuple[ServedModel, Prompt, SamplingParams]:
    """The model, the prompt (validated once, here) and the sampling parameters."""
    m = ctx.served(req.model)
    eng = m.engine
    if req.chat:
        try:  # a template may refuse messages (raise_exception) or fail on them
            text = m.chat_template.render(req.messages)
        except Exception as e:
            raise APIError(400, f"the chat template failed: {e}", param="messages") from None
        # The rendered template brings its own special tokens.
        raw: Any = m.tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(req.prompt, str):
        raw = m.tokenizer.encode(req.prompt)
    else:
        raw = req.prompt
    param = "messages" if req.chat else "prompt"
    try:
        prompt = eng.prompt(raw)
    except ContextLengthExceeded as e:
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    room = eng.max_model_len - len(prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None else room
    if max_tokens > room:
        raise APIError(
            400,
            f"this model's maximum context length is {eng.max_model_len} tokens; the "
            f"prompt has {len(prompt)} and max_tokens asks for {max_tokens}",
            param="max_tokens", code="context_length_exceeded",
        )  # fmt: skip
    try:  # (Engine.add_request clips top_k to the vocabulary)
        return m, prompt, req.sampling(max_tokens)
    except (TypeError, ValueError) as e:  # parse_* validated already; a second guard
        raise APIError(400, str(e)) from None


def start(ctx: AppContext, req: GenerationRequest) -> tuple[ServedModel, _Generation, float]:
    m, prompt, params = prepare(ctx, req)
    gen = _Generation(ctx.loop, asyncio.get_running_loop())
    arrival = time.perf_counter()
    try:
        gen.handle = ctx.loop.submit(req.model, prompt, params, gen.on_event)
    except Overloaded as e:
        ctx.metrics.requests.labels(req.model, "rejected").inc()
        raise APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded") from None
    except Unavailable as e:
        ctx.metrics.requests.labels(req.model, "unavailable").inc()
        raise APIError(503, str(e), "server_error", code="model_unavailable") from None
    return m, gen, arrival


def event_error(ctx: AppContext, model: str, err: Any) -> APIError:
    ctx.metrics.requests.labels(model, "error").inc()
    if isinstance(err, PoolExhausted):
        return APIError(400, str(err), code="kv_memory_exceeded")
    if isinstance(err, Unavailable):
        return APIError(503, str(err), "server_error", code="model_unavailable")
    return APIError(500, f"generation failed: {err!r}", "server_error")


async def events(
    ctx: AppContext, req: GenerationRequest, m: ServedModel, gen: _Generation, arrival: float
) -> AsyncIterator[tuple[str, Any]]:
    """("text", delta) items, then ("done", (reason, usage)); raises APIError."""
    text = TextStream(m.tokenizer.decode, req.stop)
    first = True
    try:
        while True:
            kind, value = await gen.events.get()
            if kind == "token":
                if first:
                    ctx.metrics.ttft.labels(req.model).observe(time.perf_counter() - arrival)
                    first = False
                delta = text.feed(value)
                if delta:
                    yield "text", delta
                if text.stopped:
                    gen.cancel()
                    reason, completion = "stop", len(text.ids)
                    break
            elif kind == "gone":
                raise _ClientGone
            elif kind == "done":
                gen.over = True
                info: Finished = value
                reason, completion = info.finish_reason, info.completion_tokens
                break
            else:
                gen.over = True
                raise event_error(ctx, req.model, value)
    finally:
        gen.cancel()  # a client that went away frees its blocks
    rest = text.flush()
    if rest:
        yield "text", rest
    ctx.metrics.latency.labels(req.model).observe(time.perf_counter() - arrival)
    ctx.metrics.requests.labels(req.model, "ok").inc()
    prompt_tokens = len(gen.handle.prompt)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    yield "done", (reason, usage)


async def watch_disconnect(request: Request, gen: _Generation) -> None:
    """Cancels a non-streaming request whose client went away (frees its blocks)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.cancel()
            gen.events.put_nowait(("gone", None))
            return


def choice(req: GenerationRequest, text: str | None, reason: str | None, delta: bool) -> dict:
    if not req.chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    if delta:
        d = {} if text is None else {"content": text}
        return {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
    msg = {"role": "assistant", "content": text}
    return {"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def generate(
    ctx: AppContext, request: Request, parse: Callable[[Any], GenerationRequest]
) -> Response:
    req = parse(await ctx.read_json(request))
    m, gen, arrival = start(ctx, req)
    rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
    obj = "chat.completion" if req.chat else "text_completion"
    head = {"id": rid, "object": obj, "created": int(time.time()), "model": req.model}
    head["seed"] = gen.handle.params.seed  # (drawn if the request gave none): replayable
    if not req.stream:
        parts, reason, usage = [], None, None
        watcher = asyncio.create_task(watch_disconnect(request, gen))
        try:
            async for kind, value in events(ctx, req, m, gen, arrival):
                if kind == "text":
                    parts.append(value)
                else:
                    reason, usage = value
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except _ClientGone:
            ctx.metrics.requests.labels(req.model, "cancelled").inc()
            return Response(status_code=499)  # nobody reads it
        finally:
            watcher.cancel()
        body = {**head, "choices": [choice(req, "".join(parts), reason, False)]}
        return JSONResponse({**body, "usage": usage})
    head = {**head, "object": "chat.completion.chunk" if req.chat else "text_completion"}

    async def stream() -> AsyncIterator[str]:
        if req.chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}  # fmt: skip
            yield _sse({**head, "choices": [role]})
        try:
            async for kind, value in events(ctx, req, m, gen, arrival):
                if kind == "text":
                    yield _sse({**head, "choices": [choice(req, value, None, True)]})
                else:
                    reason, usage = value
                    yield _sse({**head, "choices": [choice(req, None, reason, True)]})
                    if req.include_usage:
                        yield _sse({**head, "choices": [], "usage": usage})
        except APIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


def routes(ctx: AppContext) -> list[Route]:
    async def completions(request: Request) -> Response:
        ctx.auth.check(request, admin=False)
        return await generate(ctx, request, parse_completion)

    async def chat_completions(request: Request) -> Response:
        ctx.auth.check(request, admin=False)
        return await generate(ctx, request, parse_chat)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
