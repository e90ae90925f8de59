"""jax-kvcached: elastic, virtualized KV-cache memory for JAX.

Physical pages are mapped behind fixed virtual KV buffers only where blocks are in use,
shared between tenants of one :class:`Pool`, and given back when idle.

The package is layered one way: ``memory`` (pages, pools, KV caches, FFI ops) <- ``engine``
(KV manager, prefix cache, scheduler, runner, sampling) <- ``serve`` (serving loop,
OpenAI server, launch, top). ``models`` holds the Flax models behind one interface.
"""

from typing import Any

from jax_kvcached.memory import ops
from jax_kvcached.memory.config import Config, parse_bytes
from jax_kvcached.memory.errors import BackendError, KVCacheError, PoolExhausted
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.memory.ledger import MemoryLimit
from jax_kvcached.memory.pool import Pool

__version__ = "0.1.0"

# The engine and serving layers import Flax and the model code: loaded on first use, so
# ``import jax_kvcached`` stays as light as the memory layer.
_LAZY = {
    "Engine": "jax_kvcached.engine.engine",
    "RequestOutput": "jax_kvcached.engine.engine",
    "SamplingParams": "jax_kvcached.engine.sampling",
    "ServingLoop": "jax_kvcached.serve.loop",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jax_kvcached' has no attribute {name!r}")


__all__ = [
    "BackendError",
    "Config",
    "Engine",
    "KVCache",
    "KVCacheError",
    "MemoryLimit",
    "Pool",
    "PoolExhausted",
    "RequestOutput",
    "SamplingParams",
    "ServingLoop",
    "ops",
    "parse_bytes",
]
