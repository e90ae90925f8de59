"""The server answers from its first second: while the models load and compile, ``GET
/health`` says how far the warm-up is (503 ``{"status": "starting", "compiled": k,
"total": n}``) and every other route is a 503 with an OpenAI error body; then the real app
takes over."""

from __future__ import annotations

import threading
from typing import Any

from starlette.responses import JSONResponse

from jax_kvcached.serve.protocol import error_body


class Startup:
    """Warm-up progress, written by the loading thread, read by the gate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phase = "loading"  # loading -> compiling -> ready | failed
        self.compiled = 0
        self.total = 0
        self.error: str | None = None

    def progress(self, compiled: int, total: int) -> None:
        with self._lock:
            self.phase, self.compiled, self.total = "compiling", compiled, total

    def body(self) -> dict[str, Any]:
        with self._lock:
            body: dict[str, Any] = {"status": "starting", "phase": self.phase,
                                    "compiled": self.compiled, "total": self.total}  # fmt: skip
            if self.error is not None:
                body.update(status="failed", error=self.error)
            return body


class StartupGate:
    """ASGI app: the starting answers until :meth:`open` hands over to ``app``."""

    def __init__(self, state: Startup) -> None:
        self.state = state
        self.app: Any = None

    def open(self, app: Any) -> None:
        self.state.phase = "ready"
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] == "lifespan":
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            response = JSONResponse(self.state.body(), status_code=503)
        else:
            msg = "the server is starting: models are loading and compiling (see GET /health)"
            response = JSONResponse(
                error_body(msg, "server_error", code="starting"), status_code=503,
                headers={"Retry-After": "5"},
            )  # fmt: skip
        await response(scope, receive, send)
