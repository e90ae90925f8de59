"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or server-sent events).

One HTTP request becomes one engine request per choice: ``best_of`` (or ``n``) samples of
each prompt (completions take a batch of prompts). The samples of a prompt share its KV:
the first computes the prompt, the others fork its blocks, all handed to the loop at
once (``ServingLoop.submit_samples``); sample ``i`` uses seed ``seed + i``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jax_kvcached.engine.detokenizer import TextStream
from jax_kvcached.engine.engine import Prompt
from jax_kvcached.memory.errors import ContextLengthExceeded, PoolExhausted
from jax_kvcached.serve.access_log import note
from jax_kvcached.serve.auth import tenant_salt
from jax_kvcached.serve.chat_output import ChatStream, finish_reason, message
from jax_kvcached.serve.context import AppContext, ServedModel
from jax_kvcached.serve.logprobs import chat_logprobs, completion_logprobs
from jax_kvcached.serve.loop import Finished, Overloaded, ServingLoop, Unavailable
from jax_kvcached.serve.protocol import (
    APIError,
    GenerationRequest,
    parse_chat,
    parse_completion,
)

log = logging.getLogger("jax_kvcached.serve")


class _ClientGone(Exception):
    """The client disconnected before its response was complete."""


class _Generation:
    """One engine request's bridge from the loop thread's events to the asyncio side."""

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


class _Choice:
    """One sample of one prompt: its generation and what it produced."""

    def __init__(self, prompt_index: int, sample: int, prompt: Prompt, gen: _Generation) -> None:
        self.prompt_index, self.sample, self.prompt, self.gen = prompt_index, sample, prompt, gen
        self.text: list[str] = []
        self.logprobs: list[Any] = []  # (token id, logprob, top) per generated token
        self.reason: str | None = None
        self.completion_tokens = 0
        self.info: Finished | None = None

    @property
    def score(self) -> float:
        """Cumulative log-probability (best_of ranks by it)."""
        return sum(lp for _, lp, _ in self.logprobs)


def prepare(ctx: AppContext, req: GenerationRequest) -> tuple[ServedModel, list[Prompt], int]:
    """The model, the prompts (validated once, here) and the tokens each may generate."""
    m = ctx.served(req.model)
    eng = m.engine
    if req.tools is not None and req.tools.choice == "auto" and m.tool_parser is None:
        raise APIError(400, '"auto" tool choice needs the server started with '
                       "--enable-auto-tool-choice and --tool-call-parser (or tool_choice "
                       "'required', 'none' or a named function)", param="tool_choice")  # fmt: skip
    if req.chat:
        _check_template(m, req.model)
        try:  # a template may refuse messages (raise_exception) or fail on them
            tools = list(req.tools.tools) if req.tools is not None else None
            text = m.chat_template.render(req.messages, req.add_generation_prompt, tools=tools)
        except Exception as e:
            raise APIError(400, f"the chat template failed: {e}", param="messages") from None
        if req.continue_final_message:
            text = _continued(text, req.messages)
        # The rendered template brings its own special tokens (add_special_tokens: more).
        raws: list[Any] = [m.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)]
    else:
        raws = [m.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                if isinstance(p, str) else p for p in req.prompts]  # fmt: skip
    if req.truncate_prompt_tokens is not None:  # (vLLM's: the last k tokens)
        raws = [list(r)[-req.truncate_prompt_tokens :] for r in raws]
    param = "messages" if req.chat else "prompt"
    prompts = []
    for raw in raws:
        try:
            prompts.append(eng.prompt(raw))
        except ContextLengthExceeded as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
    try:
        max_tokens = eng.max_new_tokens(max(len(p) for p in prompts), req.max_tokens)
    except ContextLengthExceeded as e:
        raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
    if req.structured is not None:  # compiled here, off the event loop (then cached)
        _compile(eng, req)
    return m, prompts, max_tokens


def _check_template(m: ServedModel, model: str) -> None:
    if m.chat_template is None:  # (vLLM answers the same)
        raise APIError(400, f"model {model!r} has no chat template: use /v1/completions, or "
                       "start the server with --chat-template FILE", param="messages",
                       code="no_chat_template")  # fmt: skip


def _compile(eng: Any, req: GenerationRequest) -> None:
    """Compiles the request's structured output for the model (a 400 naming what is
    wrong with the schema or grammar)."""
    param = req.structured_param
    grammars = getattr(eng, "grammars", None)
    if grammars is None:
        raise APIError(400, "structured outputs are not served by a model spread across "
                       "hosts yet", param=param)  # fmt: skip
    try:
        grammars.compile(req.structured)
    except ImportError:
        raise APIError(400, "structured outputs need llguidance (pip install llguidance)",
                       param=param) from None  # fmt: skip
    except ValueError as e:
        raise APIError(400, f"the structured output does not compile: {e}", param=param,
                       code="invalid_structured_output") from None  # fmt: skip


def start(
    ctx: AppContext, req: GenerationRequest, prepared: tuple[ServedModel, list[Prompt], int]
) -> tuple[ServedModel, list[_Choice], int]:  # fmt: skip
    """Submits every sample of every prompt; returns the choices and the tokens each may
    generate. All or nothing: a refusal cancels what was submitted. ``prepared``: what
    :func:`prepare` returned for ``req`` (rendered and tokenized off the event loop)."""
    m, prompts, max_tokens = prepared
    need, cap = len(prompts) * req.best_of, m.engine.max_batch + ctx.loop.max_queue
    if need > cap:  # a 429 would say "retry later", which can never succeed
        param = "prompt" if req.best_of == 1 else ("n" if req.best_of == req.n else "best_of")
        raise APIError(
            400, f"this request needs {need} sequences ({len(prompts)} prompts x {req.best_of} "
            f"samples), more than this model runs and queues at once ({cap}: max_batch "
            f"{m.engine.max_batch} + max_queue {ctx.loop.max_queue})",
            param=param, code="request_too_large",
        )  # fmt: skip
    aio = asyncio.get_running_loop()
    choices: list[_Choice] = []
    try:
        for i, prompt in enumerate(prompts):
            samples = []
            for j in range(req.best_of):
                try:  # (Engine.add_request clips top_k to the vocabulary)
                    thought = None if m.constrain_thought else m.reasoning_parser
                    params = req.sampling(max_tokens, j, m.defaults, thought)
                except (TypeError, ValueError) as e:  # parse_* validated already
                    raise APIError(400, str(e)) from None
                vocab = m.engine.config.vocab_size  # checked here for a 400 (not a 500)
                if (field := params.outside_vocabulary(vocab)) is not None:
                    raise APIError(400, f"'{field}' names token ids outside the vocabulary "
                                   f"[0, {vocab})", param=field)  # fmt: skip
                samples.append((params, _Generation(ctx.loop, aio)))
            # The samples of one prompt go to the loop together: one prefill, the rest fork.
            handles = ctx.loop.submit_samples(
                req.model, prompt, [p for p, _ in samples], [g.on_event for _, g in samples],
                cache_salt=req.cache_salt, adapter=req.adapter,
            )  # fmt: skip
            for j, ((_, gen), handle) in enumerate(zip(samples, handles, strict=True)):
                gen.handle = handle
                choices.append(_Choice(i, j, prompt, gen))
    except Overloaded as e:
        _cancel(choices)
        ctx.metrics.requests.labels(req.model, "rejected").inc()
        raise APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded") from None
    except Unavailable as e:
        _cancel(choices)
        ctx.metrics.requests.labels(req.model, "unavailable").inc()
        raise APIError(503, str(e), "server_error", code="model_unavailable") from None
    except BaseException:
        _cancel(choices)
        raise
    return m, choices, max_tokens


def _cancel(choices: list[_Choice]) -> None:
    for c in choices:
        c.gen.cancel()


def event_error(err: Any) -> APIError:
    if isinstance(err, PoolExhausted):
        return APIError(400, str(err), code="kv_memory_exceeded")
    if isinstance(err, Unavailable):
        return APIError(503, str(err), "server_error", code="model_unavailable")
    return APIError(500, f"generation failed: {err!r}", "server_error")


def _continued(text: str, messages: list[dict[str, str]]) -> str:
    """The rendered chat cut after the last message's content (``continue_final_message``:
    the model goes on with it, as transformers' ``continue_final_message`` renders)."""
    last = messages[-1]
    if last["role"] != "assistant" or not last["content"]:
        raise APIError(400, "'continue_final_message' needs a final assistant message with "
                       "content", param="continue_final_message")  # fmt: skip
    at = text.rfind(last["content"])
    if at < 0:
        raise APIError(400, "the chat template does not render the final message's content "
                       "as given", param="continue_final_message")  # fmt: skip
    return text[: at + len(last["content"])]


async def events(
    req: GenerationRequest, m: ServedModel, c: _Choice, max_tokens: int, first: Callable
) -> AsyncIterator[tuple[str, Any]]:
    """One choice's ("text", (delta, logprob entries)) items, then ("done", reason);
    raises APIError or _ClientGone. ``first()`` is called at its first token."""
    text = TextStream(m.tokenizer.decode, req.stop, include_stop=req.include_stop)
    scoring_only = max_tokens == 0  # echo with max_tokens 0: the sampled token is dropped
    pending: list[Any] = []  # logprobs of tokens whose text is not out yet
    lp: Any = None
    gen = c.gen
    try:
        while True:
            kind, value = await gen.events.get()
            if kind == "logprobs":
                lp = value
            elif kind == "token":
                first()
                if scoring_only:
                    continue
                c.completion_tokens += 1
                if lp is not None:
                    entry = (value, lp[0], lp[1])
                    c.logprobs.append(entry)
                    pending.append(entry)
                    lp = None
                delta = text.feed(value)
                if delta:
                    yield "text", (delta, pending)
                    pending = []
                if text.stopped:
                    gen.cancel()
                    c.reason = "stop"
                    break
            elif kind == "gone":
                raise _ClientGone
            elif kind == "done":
                gen.over = True
                c.info = value
                c.reason = "length" if scoring_only else value.finish_reason
                break
            else:
                gen.over = True
                raise event_error(value)
    finally:
        gen.cancel()  # a client that went away frees its blocks
    rest = text.flush()
    if rest or pending:
        yield "text", (rest, pending)
    yield "done", c.reason


async def watch_disconnect(request: Request, choices: list[_Choice]) -> None:
    """Cancels a non-streaming request whose client went away (frees its blocks)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for c in choices:
                c.gen.cancel()
                c.gen.events.put_nowait(("gone", None))
            return


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Response:
    """Builds the choices of one HTTP response."""

    def __init__(self, req: GenerationRequest, m: ServedModel) -> None:
        self.streams: dict[int, ChatStream] = {}  # chat: each streamed choice's splitter
        self.req, self.m = req, m
        self.prompt_logprobs: dict[int, list[Any]] = {}  # by prompt: its first sample's

    def take_prompt_logprobs(self, choices: list[_Choice]) -> None:
        """The prompt's logprobs come from its first sample (the forks share its prefill,
        so they compute none of their own)."""
        for c in choices:
            if c.sample == 0 and c.info is not None and c.info.prompt_logprobs:
                self.prompt_logprobs[c.prompt_index] = c.info.prompt_logprobs

    def echo_text(self, c: _Choice) -> str:
        return self.m.tokenizer.decode(list(c.prompt.token_ids)) if self.req.echo else ""

    def logprobs(self, c: _Choice, entries: list[Any], with_prompt: bool) -> Any:
        req = self.req
        if req.logprobs is None:
            return None
        if req.chat:
            return chat_logprobs(self.m, entries, req.logprobs)
        if with_prompt and req.echo:
            plps = self.prompt_logprobs.get(c.prompt_index)
            return completion_logprobs(self.m, entries, req.logprobs, c.prompt, plps)
        return completion_logprobs(self.m, entries, req.logprobs)

    def choice(self, index: int, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        lps = self.logprobs(c, c.logprobs, True)
        if self.req.chat:
            m = self.m
            msg = message(text, self.req.tools, m.tool_parser, m.reasoning_parser)
            return {"index": index, "message": msg, "logprobs": lps,
                    "finish_reason": finish_reason(c.reason, msg.get("tool_calls"))}  # fmt: skip
        text = self.echo_text(c) + text
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": c.reason}

    def delta(self, index: int, text: str | None, lps: Any, reason: str | None) -> dict:
        if not self.req.chat:
            return {"index": index, "text": text or "", "logprobs": lps, "finish_reason": reason}
        d = {} if text is None else {"content": text}
        return {"index": index, "delta": d, "logprobs": lps, "finish_reason": reason}

    def deltas(self, index: int, text: str, lps: Any) -> list[dict]:
        """A streamed choice's chunks for its new text (chat: its thought, content and
        calls apart; a possible call is held)."""
        if not self.req.chat:
            return [self.delta(index, text, lps, None)]
        stream = self.streams.setdefault(index, ChatStream(
            self.req.tools, self.m.tool_parser, self.m.reasoning_parser))  # fmt: skip
        out = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in stream.feed(text)]  # fmt: skip
        if lps is not None:  # (held text's logprobs still go out, on an empty delta)
            out = out or [{"index": index, "delta": {}, "logprobs": None, "finish_reason": None}]
            out[0]["logprobs"] = lps
        return out

    def last_deltas(self, index: int, reason: str | None) -> list[dict]:
        """A streamed choice's last chunks: what it held (calls), then its reason."""
        if not self.req.chat:
            return [self.delta(index, None, None, reason)]
        stream = self.streams.get(index)
        held = stream.finish() if stream is not None else []
        out = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in held]  # fmt: skip
        calls = stream.calls if stream is not None else []
        return [*out, self.delta(index, None, None, finish_reason(reason, calls))]


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    prompt = sum(len(c.prompt) for c in choices if c.sample == 0)
    completion = sum(c.completion_tokens for c in choices)
    cached = sum(c.info.cached_tokens for c in choices if c.sample == 0 and c.info)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def _best(req: GenerationRequest, choices: list[_Choice]) -> list[_Choice]:
    """Per prompt, its ``n`` samples (of ``best_of``) with the highest cumulative
    log-probability, in prompt order (ties: lower sample index)."""
    out = []
    for i in sorted({c.prompt_index for c in choices}):
        mine = [c for c in choices if c.prompt_index == i]
        if req.best_of > req.n:
            mine = sorted(mine, key=lambda c: (-c.score, c.sample))[: req.n]
        out += mine
    return out


async def generate(
    ctx: AppContext,
    request: Request,
    parse: Callable[[Any], GenerationRequest],
    tenant: str | None = None,
) -> Response:
    """A completion or chat request of ``tenant``'s (its cached prefixes are its own)."""
    req = parse(await ctx.read_json(request))
    asked = req.model  # (a LoRA adapter's name: its base model runs it)
    base, adapter = ctx.resolve(asked)
    req = dataclasses.replace(req, cache_salt=tenant_salt(tenant, req.cache_salt), model=base,
                              adapter=adapter)  # fmt: skip
    note(request, model=asked)
    arrival = time.perf_counter()
    # The chat template and the tokenizer run in a worker thread: a large request must
    # not stall every other connection (and /health) while it is rendered.
    prepared = await asyncio.get_running_loop().run_in_executor(ctx.prepare_pool, prepare,
                                                                ctx, req)  # fmt: skip
    m, choices, max_tokens = start(ctx, req, prepared)
    first_seen = False

    def first() -> None:
        nonlocal first_seen
        if not first_seen:
            ctx.metrics.ttft.labels(req.model).observe(time.perf_counter() - arrival)
            first_seen = True

    rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{req.request_id or uuid.uuid4().hex}"
    obj = "chat.completion" if req.chat else "text_completion"
    head = {"id": rid, "object": obj, "created": int(time.time()), "model": asked}
    head["seed"] = choices[0].gen.handle.params.seed  # (drawn if none given): replayable
    build = _Response(req, m)

    def finished(ok: bool) -> None:
        usage = _usage(choices)
        note(request, prompt_tokens=usage["prompt_tokens"],
             completion_tokens=usage["completion_tokens"])  # fmt: skip
        ctx.metrics.latency.labels(req.model).observe(time.perf_counter() - arrival)
        ctx.metrics.requests.labels(req.model, "ok" if ok else "error").inc()

    if not req.stream:

        async def collect(c: _Choice) -> None:
            async for kind, value in events(req, m, c, max_tokens, first):
                if kind == "text":
                    c.text.append(value[0])

        watcher = asyncio.create_task(watch_disconnect(request, choices))
        try:
            await asyncio.gather(*(collect(c) for c in choices))
        except APIError as e:
            _cancel(choices)
            finished(False)
            return JSONResponse(e.body(), status_code=e.status)
        except _ClientGone:
            _cancel(choices)
            ctx.metrics.requests.labels(req.model, "cancelled").inc()
            return Response(status_code=499)  # nobody reads it
        finally:
            watcher.cancel()
        finished(True)
        build.take_prompt_logprobs(choices)
        picked = _best(req, choices)
        body = {**head, "choices": [build.choice(i, c) for i, c in enumerate(picked)]}
        return JSONResponse({**body, "usage": _usage(choices)})

    head = {**head, "object": "chat.completion.chunk" if req.chat else "text_completion"}
    out: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

    async def pump(index: int, c: _Choice) -> None:
        try:
            async for kind, value in events(req, m, c, max_tokens, first):
                await out.put((index, kind, value))
        except APIError as e:
            await out.put((index, "error", e))
        except BaseException as e:  # (the client went away: the stream is closed)
            if not isinstance(e, (_ClientGone, asyncio.CancelledError, GeneratorExit)):
                log.exception("a stream of model %r failed", req.model)  # (a bug: said)
            await out.put((index, "error", APIError(500, repr(e), "server_error")))

    def running() -> dict:
        return {"usage": _usage(choices)} if req.continuous_usage else {}

    async def stream() -> AsyncIterator[str]:
        tasks = []
        try:
            for index, c in enumerate(choices):
                if req.chat:
                    role = {"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}  # fmt: skip
                    yield _sse({**head, "choices": [role]})
                elif req.echo:  # (the prompt's logprobs come only in a whole response)
                    echo = build.delta(index, build.echo_text(c), None, None)
                    yield _sse({**head, "choices": [echo]})
            tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
            left, failed = len(choices), False
            while left:
                index, kind, value = await out.get()
                c = choices[index]
                if kind == "text":
                    text, entries = value
                    lps = build.logprobs(c, entries, False) if entries else None
                    for d in build.deltas(index, text, lps):
                        yield _sse({**head, "choices": [d], **running()})
                elif kind == "done":
                    left -= 1
                    for d in build.last_deltas(index, value):
                        yield _sse({**head, "choices": [d], **running()})
                else:
                    left -= 1
                    failed = True
                    yield _sse(value.body())
            finished(not failed)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(choices)})
        finally:
            _cancel(choices)
            for t in tasks:
                t.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


def routes(ctx: AppContext) -> list[Route]:
    async def completions(request: Request) -> Response:
        tenant = ctx.auth.check(request, admin=False)
        return await generate(ctx, request, parse_completion, tenant)

    async def chat_completions(request: Request) -> Response:
        tenant = ctx.auth.check(request, admin=False)
        return await generate(ctx, request, parse_chat, tenant)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
