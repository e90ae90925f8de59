"""``GET /v1/models``: the served models."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.serve.context import AppContext


def routes(ctx: AppContext) -> list[Route]:
    async def list_models(request: Request) -> Response:
        ctx.auth.check(request, admin=False)
        data = [
            {
                "id": name,
                "object": "model",
                "created": m.created,
                "owned_by": "jax-kvcached",
                "max_model_len": m.engine.max_model_len,
            }  # fmt: skip
            for name, m in ctx.models.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    return [Route("/v1/models", list_models, methods=["GET"])]
