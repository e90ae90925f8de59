"""The OpenAI-compatible HTTP app (Starlette, served by uvicorn) over a ServingLoop.

Routes, one module each under ``routes/``: ``GET /v1/models``; ``POST /v1/completions``
and ``POST /v1/chat/completions`` (``stream: true`` answers server-sent events);
``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` (vLLM's shapes); ``GET
/metrics`` (Prometheus) and ``GET /health``; ``GET|POST /admin/memory`` (per-model limits
and guarantees); ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``. The loop's
engines may live in one pool or several.

Auth (:class:`AuthConfig`): ``/v1/*`` need ``Authorization: Bearer <api_key>`` when an
API key is set; ``/admin/*`` need the admin key, and are disabled when no admin key is set
unless unauthenticated admin is allowed explicitly. ``/health`` and ``/metrics`` are open.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jax_kvcached.serve.access_log import AccessLog
from jax_kvcached.serve.auth import AuthConfig
from jax_kvcached.serve.context import AppContext, ServedModel
from jax_kvcached.serve.guard import RequestGuard
from jax_kvcached.serve.loop import ServingLoop
from jax_kvcached.serve.metrics import ServerMetrics
from jax_kvcached.serve.protocol import APIError, error_body
from jax_kvcached.serve.routes import admin, generate, health, lora, models, tokens

log = logging.getLogger("jax_kvcached.serve")

__all__ = ["AuthConfig", "BackgroundServer", "ServedModel", "create_app"]

ROUTE_MODULES = (models, generate, tokens, health, admin, lora)


def create_app(
    loop: ServingLoop,
    served: dict[str, ServedModel],
    *,
    max_body_bytes: int = 1 << 20,
    auth: AuthConfig | None = None,
    allowed_origins: list[str] | None = None,
    allowed_hosts: list[str] | None = None,
    access_log: bool = True,
) -> Any:
    """The ASGI app. ``loop`` must be started (and stopped) by the caller.
    ``allowed_origins``: browser origins allowed by CORS (``["*"]``: any; None: CORS
    off; a request with another Origin is refused). ``allowed_hosts``: the Host header
    names one of these (None: any; serve.guard). ``access_log``: one INFO line per
    request (logger ``jax_kvcached.access``)."""
    ctx = AppContext(loop, served, auth or AuthConfig(), ServerMetrics(loop), max_body_bytes)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal error (the server's log has the details)",
                                       "server_error"), 500)  # fmt: skip

    app: Any = Starlette(
        routes=[r for module in ROUTE_MODULES for r in module.routes(ctx)],
        exception_handlers={
            APIError: on_api_error,
            HTTPException: on_http_error,
            Exception: on_crash,
        },
    )
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(
            app, allow_origins=allowed_origins, allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )  # fmt: skip
    app = RequestGuard(app, allowed_hosts, allowed_origins)
    return AccessLog(app) if access_log else app


class BackgroundServer:
    """Runs an ASGI app with uvicorn in a thread on a loopback port (tests, benchmarks)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
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
    def thread(self) -> threading.Thread:
        """The thread the server's event loop runs in."""
        return self._thread

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
