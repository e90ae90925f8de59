"""jax-kvcached: elastic, virtualized KV-cache memory for JAX.

Physical pages are mapped behind fixed virtual KV buffers only where blocks are in use,
shared between tenants of one :class:`Pool`, and given back when idle.
"""

from jax_kvcached import ops
from jax_kvcached.config import Config, parse_bytes
from jax_kvcached.errors import BackendError, KVCacheError, PoolExhausted
from jax_kvcached.kv_cache import KVCache
from jax_kvcached.pool import Pool

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Config",
    "KVCache",
    "KVCacheError",
    "Pool",
    "PoolExhausted",
    "ops",
    "parse_bytes",
]
