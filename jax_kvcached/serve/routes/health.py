"""``GET /health`` and ``GET /metrics`` (Prometheus): open, no key needed."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.serve.context import AppContext
from jax_kvcached.serve.metrics import CONTENT_TYPE


def routes(ctx: AppContext) -> list[Route]:
    async def health(request: Request) -> Response:
        state = {n: "failed" if n in ctx.loop.failed else "ok" for n in ctx.models}
        ok = ctx.loop.running and any(v == "ok" for v in state.values())
        body = {"status": "ok" if ok else "unavailable", "models": state}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
