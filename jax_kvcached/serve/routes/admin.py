"""Admin routes (the admin key is required): ``GET|POST /admin/memory`` (per-model
limits and guarantees, in whichever pool each model lives; each model's sleep state) and
``POST /admin/sleep`` / ``POST /admin/wake`` (a model's weights and KV memory given back,
and brought back), ``POST /reset_prefix_cache`` (vLLM's route: every idle cached prefix
of each model, or of ``?model=NAME`` / ``{"model": NAME}``, forgotten on the device and
in the host tier)."""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.serve.context import AppContext
from jax_kvcached.serve.loop import Conflict, Unavailable
from jax_kvcached.serve.protocol import APIError
from jax_kvcached.serve.sleep_mailbox import record_fields


def _sleep_body(body: Any, fields: set[str]) -> str:
    if not isinstance(body, dict) or set(body) - fields or "model" not in body:
        keys = ", ".join(f"'{f}'" for f in sorted(fields))
        raise APIError(400, f"expected a JSON object with 'model' (keys: {keys})")
    if not isinstance(body["model"], str):
        raise APIError(400, "'model' must be a string", param="model")
    return body["model"]


def routes(ctx: AppContext) -> list[Route]:
    def model(name: str) -> str:
        """A served model's name (404 for an unknown one; 400 for a LoRA adapter)."""
        base, adapter = ctx.resolve(name)
        if adapter is not None:
            raise APIError(400, f"{name!r} is a LoRA adapter of {base!r}: name the model",
                           param="model")  # fmt: skip
        return base

    async def command(name: str, call: Any) -> Response:
        model(name)  # 404 first
        try:
            out = await run_in_threadpool(call)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except Conflict as e:
            raise APIError(409, str(e), code="conflict") from None
        except Unavailable as e:
            raise APIError(503, str(e), type="server_error") from None
        except TimeoutError:
            raise APIError(
                504, f"model {name!r} did not finish in time", type="server_error"
            ) from None
        return JSONResponse({"model": name, **out})

    async def sleep(request: Request) -> Response:
        ctx.auth.check(request, admin=True)
        body = await ctx.read_json(request)
        name = _sleep_body(body, {"model", "level", "abort"})
        level = body.get("level", ctx.loop.sleep_level)
        if isinstance(level, bool) or level not in (1, 2):
            raise APIError(400, f"'level' must be 1 or 2, got {level!r}", param="level")
        abort = body.get("abort", False)
        if not isinstance(abort, bool):
            raise APIError(400, "'abort' must be true or false", param="abort")
        return await command(name, lambda: ctx.loop.sleep(name, level, abort=abort))

    async def wake(request: Request) -> Response:
        ctx.auth.check(request, admin=True)
        name = _sleep_body(await ctx.read_json(request), {"model"})
        return await command(name, lambda: ctx.loop.wake(name))

    async def memory(request: Request) -> Response:
        ctx.auth.check(request, admin=True)
        if request.method == "POST":
            body = await ctx.read_json(request)
            if not isinstance(body, dict) or set(body) - {"model", "limit", "guarantee"}:
                raise APIError(400, "expected {'model': ..., 'limit': ..., 'guarantee': ...}")
            name = body.get("model")
            if not isinstance(name, str):
                raise APIError(400, "'model' must be a string", param="model")
            pool = ctx.models[model(name)].engine.pool
            for field in ("guarantee", "limit"):  # the guarantee first (it may rise with it)
                if field not in body:
                    continue
                try:
                    if field == "guarantee":
                        pool.set_memory_guarantee(name, body[field])
                    else:
                        pool.set_memory_limit(name, body[field])
                except (ValueError, TypeError) as e:
                    raise APIError(400, str(e), param=field) from None
        limits = {}
        for name, m in ctx.models.items():
            r = m.engine.pool.memory_limit_of(name)
            limits[name] = {**dataclasses.asdict(r), "applied": r.applied,
                            "kv_cache_groups": m.engine.kv.group_stats(),
                            "sleeping": m.engine.sleeping,
                            "sleep_level": m.engine.sleep_level,
                            "lora": m.engine.stats()["lora"],
                            **m.engine.runner.weight_bytes()}  # fmt: skip
        pools = [
            {
                "device": str(p.device),
                "devices": [str(d) for d in p.devices],
                "tensor_parallel": p.tensor_parallel,
                "budget_bytes": p.memory_limit,  # on each device of a tensor-parallel pool
                "mapped_pages_per_device": p.mapped_pages_per_device(),
                "models": sorted(p.caches),
                "group": p.group,
            }
            for p in ctx.loop.pools()
        ]
        budget = sum(p["budget_bytes"] for p in pools)
        groups = {
            p.group: [record_fields(r) for r in p.group_records() or []]
            for p in ctx.loop.pools()
            if p.group is not None
        }
        body = {"budget_bytes": budget, "pools": pools, "models": limits, "groups": groups}
        return JSONResponse(body)

    async def reset_prefix_cache(request: Request) -> Response:
        ctx.auth.check(request, admin=True)
        name = request.query_params.get("model")
        if int(request.headers.get("content-length") or 0):  # (vLLM's takes no body)
            body = await ctx.read_json(request)
            if not isinstance(body, dict) or set(body) - {"model"}:
                raise APIError(400, "expected no body or {'model': NAME}")
            name = body.get("model", name)
            if not isinstance(name, str | None):
                raise APIError(400, "'model' must be a string", param="model")
        if name is not None:
            model(name)  # 404 first
        names = list(ctx.models) if name is None else [name]
        evicted = {}
        for n in names:
            evicted[n] = await run_in_threadpool(ctx.models[n].engine.reset_prefix_cache)
        return JSONResponse({"evicted_blocks": evicted})

    return [
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/admin/memory", memory, methods=["GET", "POST"]),
        Route("/admin/sleep", sleep, methods=["POST"]),
        Route("/admin/wake", wake, methods=["POST"]),
    ]
