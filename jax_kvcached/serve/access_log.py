"""A one-line access log per request: client, method, route, model, status, tokens and
latency (logger ``jax_kvcached.access``), written when the response's last byte is sent
(a stream's too). Routes add the model and token counts through :func:`note`."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("jax_kvcached.access")


def note(request: Any, **fields: Any) -> None:
    """Adds ``model=``, ``prompt_tokens=``, ``completion_tokens=`` to a request's line."""
    request.scope.setdefault("state", {}).setdefault("access", {}).update(fields)


class AccessLog:
    """ASGI middleware around the app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def send_and_log(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                _write(scope, status[0], time.perf_counter() - t0)

        try:
            await self.app(scope, receive, send_and_log)
        except BaseException:
            if status[0] == 0:
                _write(scope, 500, time.perf_counter() - t0)
            raise


def _write(scope: dict, status: int, seconds: float) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    client = scope.get("client") or ("-", 0)
    extra = (scope.get("state") or {}).get("access", {})
    tokens = ""
    if "prompt_tokens" in extra:
        tokens = f" tokens={extra['prompt_tokens']}+{extra.get('completion_tokens', 0)}"
    log.info(
        '%s "%s %s" model=%s %d%s %.3fs', client[0], scope["method"], scope["path"],
        extra.get("model", "-"), status, tokens, seconds,
    )  # fmt: skip
