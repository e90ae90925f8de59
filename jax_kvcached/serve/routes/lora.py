"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's routes,
with ``--enable-lora``; the admin key, as ``/admin/*``): ``{"lora_name", "lora_path",
"base_model_name"?}`` loads a PEFT folder onto its base model, ``{"lora_name"}`` drops
one no request uses. A request's ``model`` may then name the adapter."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.models.lora import AdapterError
from jax_kvcached.serve.adapters import AdapterSpec, base_of, load
from jax_kvcached.serve.context import AppContext
from jax_kvcached.serve.protocol import APIError


def _body(body: Any, required: set[str], optional: set[str] = frozenset()) -> dict[str, str]:
    keys = required | optional
    if not isinstance(body, dict) or not required <= set(body) or set(body) - keys:
        names = ", ".join(f"'{k}'" for k in sorted(required))
        raise APIError(400, f"expected a JSON object with {names} (and optionally "
                       f"{', '.join(sorted(optional)) or 'nothing'})")  # fmt: skip
    for k, v in body.items():
        if not isinstance(v, str) or not v:
            raise APIError(400, f"'{k}' must be a non-empty string", param=k)
    return body


def routes(ctx: AppContext) -> list[Route]:
    def enabled() -> None:
        if not any(getattr(m.engine, "adapters", None) is not None
                   and m.engine.adapters.max_loras for m in ctx.models.values()):  # fmt: skip
            raise APIError(400, "LoRA adapters are off: start the server with --enable-lora")

    async def load_adapter(request: Request) -> Response:
        ctx.auth.check(request, admin=True)
        enabled()
        b = _body(await ctx.read_json(request), {"lora_name", "lora_path"}, {"base_model_name"})
        spec = AdapterSpec(b["lora_name"], b["lora_path"], b.get("base_model_name"))
        try:
            adapter = await run_in_threadpool(load, ctx.models, spec)
        except ValueError as e:  # (an AdapterError names the file and field)
            param = "lora_path" if isinstance(e, AdapterError) else "lora_name"
            raise APIError(400, str(e), param=param, code="invalid_lora_adapter") from None
        return JSONResponse({"lora_name": spec.name, "rank": adapter.rank,
                             "base_model_name": base_of(ctx.models, spec.name)})  # fmt: skip

    async def unload_adapter(request: Request) -> Response:
        ctx.auth.check(request, admin=True)
        enabled()
        name = _body(await ctx.read_json(request), {"lora_name"})["lora_name"]
        base = base_of(ctx.models, name)
        if base is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                           code="model_not_found")  # fmt: skip
        try:
            await run_in_threadpool(ctx.models[base].engine.unload_adapter, name)
        except ValueError as e:  # in use by a request
            raise APIError(409, str(e), code="conflict") from None
        return JSONResponse({"lora_name": name, "unloaded": True})

    return [
        Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
    ]
