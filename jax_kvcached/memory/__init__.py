"""The memory layer: physical pages behind fixed virtual KV buffers.

``config`` (settings) -> ``ledger`` (who may map how much) -> ``allocator`` (blocks on
pages) -> ``kv_cache`` (one tenant's buffer and view) -> ``pool`` (a device budget and its
caches); ``ops`` are the XLA FFI custom calls over a cache; ``_C`` the C++ core.
Nothing here imports the engine or the serving layer.
"""
