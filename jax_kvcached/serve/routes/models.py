"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served models, and the LoRA
adapters loaded onto them (``parent``: their base)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.serve.adapters import cards as adapter_cards
from jax_kvcached.serve.context import AppContext


def routes(ctx: AppContext) -> list[Route]:
    def card(name: str) -> dict:
        m = ctx.models[name]
        return {
            "id": name,
            "object": "model",
            "created": m.created,
            "owned_by": "jax-kvcached",
            "max_model_len": m.engine.max_model_len,
        }

    async def list_models(request: Request) -> Response:
        ctx.auth.check(request, admin=False)
        data = [card(n) for n in ctx.models] + adapter_cards(ctx.models)
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        ctx.auth.check(request, admin=False)
        name = request.path_params["model"]
        if ctx.resolve(name)[1] is not None:  # (404 model_not_found for an unknown one)
            return JSONResponse(next(c for c in adapter_cards(ctx.models) if c["id"] == name))
        return JSONResponse(card(name))

    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    ]
