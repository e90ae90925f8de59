"""One served model's figures as the server reports them (``/admin/memory``, metrics,
``top``): its engine's queue, memory and prefix-cache figures flattened, beside the
serving loop's own counters for it."""

from __future__ import annotations

from typing import Any


def model_stats(e: dict[str, Any], pool_limit: int, loop: dict[str, Any]) -> dict[str, Any]:
    """``e``: the engine's ``stats()``; ``pool_limit``: its pool's memory limit (the KV
    usage's denominator when the model has no limit of its own); ``loop``: the loop's
    counters for the model, reported as they are."""
    pc, hc = e["prefix_cache"], e["host_cache"] or {}
    queries = pc["queries_tokens"] if pc else 0
    return {
        "waiting": e["waiting"],
        "running": e["running"],
        "max_batch": e["max_batch"],
        "preemptions": e["preemptions"],
        "mapped_bytes": e["mapped_bytes"],
        "weight_bytes": e["weight_bytes"],
        "weight_packed_bytes": e["weight_packed_bytes"],
        "limit_bytes": e["limit_bytes"],
        # KV memory in use of what the model may map (its limit, else the pool)
        "kv_usage": e["mapped_bytes"] / (e["limit_bytes"] or pool_limit),
        "guarantee_bytes": e["guarantee_bytes"],
        "prefix_hit_rate": pc["hit_rate"] if pc else 0.0,
        "prefix_cached_tokens": pc["cached_tokens"] if pc else 0,
        "prefix_hits_tokens": pc["hits_tokens"] if pc else 0,
        "prefix_queries_tokens": queries,
        # the prefix cache's host tier (zeros without one)
        "host_hit_rate": hc["hits_tokens"] / queries if hc and queries else 0.0,
        "host_hits_tokens": hc.get("hits_tokens", 0),
        "host_restores": hc.get("restores", 0),
        "host_bytes_to_host": hc.get("bytes_to_host", 0),
        "host_bytes_from_host": hc.get("bytes_from_host", 0),
        "host_entries": hc.get("entries", 0),
        "host_bytes": hc.get("bytes", 0),
        "host_capacity_bytes": hc.get("capacity_bytes", 0),
        "kv_cache_groups": e["kv_cache_groups"],
        # LoRA adapters: their slots' device bytes and the adapters loaded
        "lora_slot_bytes": e["lora"]["slot_bytes"],
        "lora_adapters": [a["name"] for a in e["lora"]["adapters"]],
        "sleeping": e["sleeping"],
        "sleep_level": e["sleep_level"],
        **loop,
    }
