"""``GET /health`` and ``GET /metrics`` (Prometheus).

With no key configured both are open, as the rest of a loopback server is. With keys,
the detail that tells a stranger about tenants (model names, the process group's tenants
and PIDs, prefix-hit counters: an oracle for guessing cached prompts) needs one: with an
API key set, ``/metrics`` needs it (or the admin key; routers that poll the load figures
send the key they forward requests with), and ``/health`` answers its status to anyone
but names the models only to a caller with a key. (With only an admin key, ``/v1/*`` is
open and so is ``/metrics``.)"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.serve.context import AppContext
from jax_kvcached.serve.metrics import CONTENT_TYPE
from jax_kvcached.serve.protocol import APIError


def routes(ctx: AppContext) -> list[Route]:
    auth = ctx.auth

    def holds_a_key(request: Request, operator: bool = False) -> bool:
        """Whether the caller holds the API key (anyone, when none is set) or the admin
        key. ``operator``: a named tenant's key does not count (the server's counters
        are every tenant's)."""
        for admin in (False, True):
            if admin and auth.admin_key is None:
                break
            try:
                tenant = auth.check(request, admin)
            except APIError:
                continue
            if tenant is None or not operator:
                return True
        return False

    async def health(request: Request) -> Response:
        state = {n: "failed" if n in ctx.loop.failed else "ok" for n in ctx.models}
        ok = ctx.loop.running and any(v == "ok" for v in state.values())
        body: dict = {"status": "ok" if ok else "unavailable"}
        if holds_a_key(request):
            body["models"] = state
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        if not holds_a_key(request, operator=True):
            if auth.check(request, admin=False) is not None:  # (else the 401)
                raise APIError(403, "/metrics needs the API key or the admin key: a "
                               "tenant's key does not read every tenant's counters",
                               code="forbidden")  # fmt: skip
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
