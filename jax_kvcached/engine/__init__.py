"""The engine layer: continuous batching of one model over a KV cache.

``sampling`` and ``attention`` are pure jitted functions; ``runner`` runs packed steps;
``prefix_cache`` + ``eviction`` keep idle KV blocks for reuse; ``kv_manager`` is the one
seam between requests and KV memory (admission, growth, release, reclaim, the device
fence); ``scheduler`` keeps queue policy only; ``engine`` ties them into a step loop.
Nothing here imports the serving layer.
"""
