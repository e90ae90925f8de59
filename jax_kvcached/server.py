"""OpenAI-compatible HTTP server (Starlette on uvicorn) over a ServingLoop.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` answers server-sent events), ``GET /metrics`` (Prometheus),
``GET /health``, ``GET|POST /admin/memory`` (per-model limits and guarantees).

Auth (:class:`AuthConfig`): ``/v1/*`` need ``Authorization: Bearer <api_key>`` when an
API key is set; ``/admin/*`` need the admin key, and are disabled when no admin key is set
unless unauthenticated admin is allowed explicitly. ``/health`` and ``/metrics`` are open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jax_kvcached.chat_template import ChatTemplate
from jax_kvcached.engine import Engine
from jax_kvcached.errors import ContextLengthExceeded, PoolExhausted
from jax_kvcached.metrics import CONTENT_TYPE, ServerMetrics
from jax_kvcached.openai_protocol import (
    APIError,
    GenerationRequest,
    TextStream,
    error_body,
    parse_chat,
    parse_completion,
)
from jax_kvcached.pool import Pool
from jax_kvcached.serving import Finished, Overloaded, ServingLoop, Unavailable


@dataclasses.dataclass
class ServedModel:
    engine: Engine
    tokenizer: Any  # encode(str, add_special_tokens=True) -> ids, decode(ids) -> str
    chat_template: ChatTemplate = dataclasses.field(default_factory=ChatTemplate)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _error(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Who may call what. Keys are compared in constant time."""

    api_key: str | None = None  # required on /v1/* when set
    admin_key: str | None = None  # required on /admin/* when set
    allow_unauthenticated_admin: bool = False  # /admin/* open when no admin key is set

    def check(self, request: Request, admin: bool) -> None:
        """Raises APIError 401 / 403 unless ``request`` may call its route."""
        if admin:
            if self.admin_key is None:
                if self.allow_unauthenticated_admin:
                    return
                raise APIError(
                    403, "admin routes are disabled: start the server with --admin-key "
                    "(or --allow-unauthenticated-admin)", code="admin_disabled",
                )  # fmt: skip
            key = self.admin_key
        elif self.api_key is None:
            return
        else:
            key = self.api_key
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), key.encode()
        )
        if not ok:
            what = "admin key" if admin else "API key"
            raise APIError(
                401, f"invalid or missing {what}: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )  # fmt: skip


class _ClientGone(Exception):
    """The client disconnected before its response was complete."""


def parse_json(raw: bytes) -> Any:
    """JSON from a request body; APIError 400 on anything that is not plain JSON."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise APIError(400, "could not parse the JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"could not parse the JSON body: {e}") from None


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


def create_app(
    loop: ServingLoop,
    models: dict[str, ServedModel],
    pool: Pool,
    *,
    max_body_bytes: int = 1 << 20,
    auth: AuthConfig | None = None,
) -> Starlette:
    """The ASGI app. ``loop`` must be started (and stopped) by the caller."""
    metrics = ServerMetrics(loop, pool)
    auth = auth or AuthConfig()
    too_large = APIError(413, f"request body over {max_body_bytes} bytes")

    async def read_json(request: Request) -> Any:
        """The body, read chunk by chunk and refused (413) as soon as it is too large."""
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, f"bad Content-Length {length[:32]!r}")
            if int(length) > max_body_bytes:
                raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    def served(name: str) -> ServedModel:
        m = models.get(name)
        if m is None:
            raise APIError(
                404, f"the model '{name}' does not exist; have {sorted(models)}",
                param="model", code="model_not_found",
            )  # fmt: skip
        return m

    def prepare(req: GenerationRequest) -> tuple[ServedModel, list[int], Any]:
        m = served(req.model)
        eng = m.engine
        if req.chat:
            try:  # a template may refuse messages (raise_exception) or fail on them
                text = m.chat_template.render(req.messages)
            except Exception as e:
                raise APIError(400, f"the chat template failed: {e}", param="messages") from None
            # The rendered template brings its own special tokens.
            prompt: Any = m.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(req.prompt, str):
            prompt = m.tokenizer.encode(req.prompt)
        else:
            prompt = req.prompt
        param = "messages" if req.chat else "prompt"
        try:
            ids = eng.encode(prompt)
        except ContextLengthExceeded as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        room = eng.max_model_len - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        if max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {eng.max_model_len} tokens; the "
                f"prompt has {len(ids)} and max_tokens asks for {max_tokens}",
                param="max_tokens", code="context_length_exceeded",
            )  # fmt: skip
        try:  # (Engine.add_request clips top_k to the vocabulary)
            return m, ids, req.sampling(max_tokens)
        except (TypeError, ValueError) as e:  # parse_* validated already; a second guard
            raise APIError(400, str(e)) from None

    def start(req: GenerationRequest) -> tuple[ServedModel, _Generation, float]:
        m, ids, params = prepare(req)
        gen = _Generation(loop, asyncio.get_running_loop())
        arrival = time.perf_counter()
        try:
            gen.handle = loop.submit(req.model, ids, params, gen.on_event)
        except Overloaded as e:
            metrics.requests.labels(req.model, "rejected").inc()
            raise APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded") from None
        except Unavailable as e:
            metrics.requests.labels(req.model, "unavailable").inc()
            raise APIError(503, str(e), "server_error", code="model_unavailable") from None
        return m, gen, arrival

    def event_error(model: str, err: Any) -> APIError:
        metrics.requests.labels(model, "error").inc()
        if isinstance(err, PoolExhausted):
            return APIError(400, str(err), code="kv_memory_exceeded")
        if isinstance(err, Unavailable):
            return APIError(503, str(err), "server_error", code="model_unavailable")
        return APIError(500, f"generation failed: {err!r}", "server_error")

    async def events(
        req: GenerationRequest, m: ServedModel, gen: _Generation, arrival: float
    ) -> AsyncIterator[tuple[str, Any]]:
        """("text", delta) items, then ("done", (reason, usage)); raises APIError."""
        text = TextStream(m.tokenizer.decode, req.stop)
        first = True
        try:
            while True:
                kind, value = await gen.events.get()
                if kind == "token":
                    if first:
                        metrics.ttft.labels(req.model).observe(time.perf_counter() - arrival)
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
                    raise event_error(req.model, value)
        finally:
            gen.cancel()  # a client that went away frees its blocks
        rest = text.flush()
        if rest:
            yield "text", rest
        metrics.latency.labels(req.model).observe(time.perf_counter() - arrival)
        metrics.requests.labels(req.model, "ok").inc()
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

    def choice(req: GenerationRequest, text: str | None, reason: str | None, delta: bool):
        if not req.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        if delta:
            d = {} if text is None else {"content": text}
            return {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        msg = {"role": "assistant", "content": text}
        return {"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}

    async def generate(request: Request, parse: Callable[[Any], GenerationRequest]) -> Response:
        req = parse(await read_json(request))
        m, gen, arrival = start(req)
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if req.chat else "text_completion"
        created = int(time.time())
        head = {"id": rid, "object": obj, "created": created, "model": req.model}
        head["seed"] = gen.handle.params.seed  # (drawn if the request gave none): replayable
        if not req.stream:
            parts, reason, usage = [], None, None
            watcher = asyncio.create_task(watch_disconnect(request, gen))
            try:
                async for kind, value in events(req, m, gen, arrival):
                    if kind == "text":
                        parts.append(value)
                    else:
                        reason, usage = value
            except APIError as e:
                return _error(e)
            except _ClientGone:
                metrics.requests.labels(req.model, "cancelled").inc()
                return Response(status_code=499)  # nobody reads it
            finally:
                watcher.cancel()
            body = {**head, "choices": [choice(req, "".join(parts), reason, False)]}
            return JSONResponse({**body, "usage": usage})
        chunk_obj = "chat.completion.chunk" if req.chat else "text_completion"
        head = {**head, "object": chunk_obj}

        def sse(payload: Any) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def stream() -> AsyncIterator[str]:
            if req.chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}  # fmt: skip
                yield sse({**head, "choices": [role]})
            try:
                async for kind, value in events(req, m, gen, arrival):
                    if kind == "text":
                        yield sse({**head, "choices": [choice(req, value, None, True)]})
                    else:
                        reason, usage = value
                        yield sse({**head, "choices": [choice(req, None, reason, True)]})
                        if req.include_usage:
                            yield sse({**head, "choices": [], "usage": usage})
            except APIError as e:
                yield sse(e.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        auth.check(request, admin=False)
        return await generate(request, parse_completion)

    async def chat_completions(request: Request) -> Response:
        auth.check(request, admin=False)
        return await generate(request, parse_chat)

    async def list_models(request: Request) -> Response:
        auth.check(request, admin=False)
        data = [
            {
                "id": name,
                "object": "model",
                "created": m.created,
                "owned_by": "jax-kvcached",
                "max_model_len": m.engine.max_model_len,
            }  # fmt: skip
            for name, m in models.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        state = {n: "failed" if n in loop.failed else "ok" for n in models}
        ok = loop.running and any(v == "ok" for v in state.values())
        body = {"status": "ok" if ok else "unavailable", "models": state}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def memory(request: Request) -> Response:
        auth.check(request, admin=True)
        if request.method == "POST":
            body = await read_json(request)
            if not isinstance(body, dict) or set(body) - {"model", "limit", "guarantee"}:
                raise APIError(400, "expected {'model': ..., 'limit': ..., 'guarantee': ...}")
            name = body.get("model")
            if not isinstance(name, str):
                raise APIError(400, "'model' must be a string", param="model")
            served(name)
            try:  # limit first when lowering the guarantee with it, else guarantee first
                if "guarantee" in body:
                    pool.set_memory_guarantee(name, body["guarantee"])
                if "limit" in body:
                    pool.set_memory_limit(name, body["limit"])
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), param="limit") from None
        limits = {
            n: {**dataclasses.asdict(r), "applied": r.applied}
            for n, r in pool.memory_limits().items()
        }
        return JSONResponse({"budget_bytes": pool.memory_limit, "models": limits})

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _error(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    async def on_crash(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), 500)

    return Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/admin/memory", memory, methods=["GET", "POST"]),
        ],
        exception_handlers={
            APIError: on_api_error,
            HTTPException: on_http_error,
            Exception: on_crash,
        },
    )


class BackgroundServer:
    """Runs an ASGI app with uvicorn in a thread on a loopback port (tests, benchmarks)."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
