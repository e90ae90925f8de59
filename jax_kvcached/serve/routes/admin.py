"""``GET|POST /admin/memory``: per-model limits and guarantees, in whichever pool each
model lives (the admin key is required)."""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.serve.context import AppContext
from jax_kvcached.serve.protocol import APIError


def routes(ctx: AppContext) -> list[Route]:
    async def memory(request: Request) -> Response:
        ctx.auth.check(request, admin=True)
        if request.method == "POST":
            body = await ctx.read_json(request)
            if not isinstance(body, dict) or set(body) - {"model", "limit", "guarantee"}:
                raise APIError(400, "expected {'model': ..., 'limit': ..., 'guarantee': ...}")
            name = body.get("model")
            if not isinstance(name, str):
                raise APIError(400, "'model' must be a string", param="model")
            pool = ctx.served(name).engine.pool
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
                            "kv_cache_groups": m.engine.kv.group_stats()}  # fmt: skip
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
            p.group: [dataclasses.asdict(r) for r in p.group_records() or []]
            for p in ctx.loop.pools()
            if p.group is not None
        }
        body = {"budget_bytes": budget, "pools": pools, "models": limits, "groups": groups}
        return JSONResponse(body)

    return [Route("/admin/memory", memory, methods=["GET", "POST"])]
