"""The C++ core's XLA FFI targets (``kvcached_*``), registered with JAX once on import.

The one module of the memory layer a model may import (by name, as the structure test
allows): a model that calls a kernel of the core (the packed-weight matmul, the grouped
expert matmul) imports it where it builds the call, so the models still import and run
their portable paths without it.
"""

from __future__ import annotations

import jax

from jax_kvcached.memory import _C

PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}  # the core's platform names -> JAX's
_registered = False


def register() -> None:
    """Registers every handler of this build with JAX (idempotent)."""
    global _registered
    if _registered:
        return
    for platform, table in _C.handlers.items():
        for op, capsule in table.items():
            jax.ffi.register_ffi_target(f"kvcached_{op}", capsule, platform=PLATFORMS[platform])
    _registered = True


register()
