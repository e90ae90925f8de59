"""Requests a browser page or a rebinding DNS name could send: refused before any route.

A web page the operator visits can send simple cross-site requests to a loopback server
(a ``text/plain`` POST, no preflight), and a DNS name rebound to 127.0.0.1 can even read
the answers. So: a request whose ``Host`` is not an allowed host is refused (400; by
default, on a loopback bind, only ``localhost``, ``127.0.0.1`` and ``[::1]``), and one
whose ``Origin`` CORS does not allow is refused (403). JSON bodies must say
``Content-Type: application/json`` (415, :meth:`AppContext.read_json`): a browser sends
that cross-site only after a preflight, which CORS (off by default) refuses.
"""

from __future__ import annotations

import json
from typing import Any

from jax_kvcached.serve.protocol import error_body


def _hostname(host: str) -> str:
    """``host`` of a Host header value ``host[:port]`` / ``[v6]:port``, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    """ASGI middleware: the Host and Origin checks of the module docstring.
    ``allowed_hosts``: host names (None: any); ``allowed_origins``: CORS's (``["*"]``:
    any; None: none, so any request with an Origin header is refused)."""

    def __init__(self, app: Any, allowed_hosts: list[str] | None,
                 allowed_origins: list[str] | None) -> None:  # fmt: skip
        self.app = app
        self.hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.origins = set(allowed_origins or ())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}  # fmt: skip
        if self.hosts is not None and _hostname(headers.get("host", "")) not in self.hosts:
            return await _refuse(send, 400, "the Host header names a host this server does "
                                 "not answer for (see --allowed-hosts)")  # fmt: skip
        origin = headers.get("origin")
        if origin is not None and "*" not in self.origins and origin not in self.origins:
            return await _refuse(send, 403, "cross-origin requests are refused (see "
                                 "--allowed-origins)")  # fmt: skip
        return await self.app(scope, receive, send)


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
