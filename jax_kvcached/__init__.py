"""jax-kvcached: elastic, virtualized KV-cache memory for JAX.

Physical pages are mapped behind fixed virtual KV buffers only where blocks are in use,
shared between tenants of one :class:`Pool`, and given back when idle.

The package is layered one way: ``memory`` (pages, pools, KV caches, FFI ops) <- ``engine``
(KV manager, prefix cache, scheduler, runner, sampling) <- ``serve`` (serving loop,
OpenAI server, launch, top). ``models`` holds the Flax models behind one interface.
"""

from typing import Any

__version__ = "0.1.0"

# Loaded on first use, so ``import jax_kvcached`` (and tools such as ``top`` and ``ctl``)
# start without importing JAX, Flax or the model code.
_LAZY = {
    "BackendError": "jax_kvcached.memory.errors",
    "KVCacheError": "jax_kvcached.memory.errors",
    "PoolExhausted": "jax_kvcached.memory.errors",
    "Config": "jax_kvcached.memory.config",
    "parse_bytes": "jax_kvcached.memory.config",
    "MemoryLimit": "jax_kvcached.memory.ledger",
    "KVCache": "jax_kvcached.memory.kv_cache",
    "Pool": "jax_kvcached.memory.pool",
    "device_memory_bytes": "jax_kvcached.memory.pool",
    "Engine": "jax_kvcached.engine.engine",
    "RequestOutput": "jax_kvcached.engine.engine",
    "SamplingParams": "jax_kvcached.engine.sampling",
    "EngineConfig": "jax_kvcached.engine.config",
    "paged_attention": "jax_kvcached.engine.attention",
    "dense_causal_attention": "jax_kvcached.engine.attention",
    "Ragged": "jax_kvcached.engine.attention",
    "ServingLoop": "jax_kvcached.serve.loop",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "ops":
        return importlib.import_module("jax_kvcached.memory.ops")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jax_kvcached' has no attribute {name!r}")


__all__ = [
    "BackendError",
    "Config",
    "Engine",
    "EngineConfig",
    "KVCache",
    "KVCacheError",
    "MemoryLimit",
    "Pool",
    "PoolExhausted",
    "Ragged",
    "RequestOutput",
    "SamplingParams",
    "dense_causal_attention",
    "device_memory_bytes",
    "ServingLoop",
    "ops",
    "paged_attention",
    "parse_bytes",
]
