"""Every trace, lowering and XLA compile in this process, counted from JAX's own
monitoring events: the ground truth for "nothing compiled after warm-up" (a retrace for
any reason, a stray eager op, a persistent-cache load: all of them show here).

``compile_events()`` returns the counts so far; take one before and one after the work
to check. The listener is registered once, on first use.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "traces",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings",
    "/jax/core/compile/backend_compile_duration": "compiles",
}
_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()
_names: collections.Counter = collections.Counter()  # (kind, function name) -> count
_registered = False
_local = threading.local()  # this thread's persistent-cache loads (listeners run in it)


def _listener(event: str, duration: float, **kwargs: Any) -> None:
    kind = _EVENTS.get(event)
    if kind is None:
        return
    with _lock:
        _counts[kind] += 1
        _names[kind, str(kwargs.get("fun_name", "?"))] += 1


_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _hit_listener(event: str, **kwargs: Any) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1
        _local.hits = getattr(_local, "hits", 0) + 1


def _register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    import jax

    jax.monitoring.register_event_duration_secs_listener(_listener)
    jax.monitoring.register_event_listener(_hit_listener)


def thread_cache_hits() -> int:
    """Loads from JAX's persistent compilation cache made by the calling thread so far
    (a compile in this thread that moved it was such a load, whatever other threads
    compile meanwhile)."""
    _register()
    return getattr(_local, "hits", 0)


def compile_events() -> dict[str, int]:
    """Traces, lowerings, compiles (each an XLA compile or a load from the persistent
    compilation cache) and ``cache_hits`` (those loads) so far."""
    _register()
    with _lock:
        out = {kind: _counts[kind] for kind in _EVENTS.values()}
        out["cache_hits"] = _counts["cache_hits"]
        return out


def fresh_compiles(before: dict[str, int], after: dict[str, int]) -> int:
    """XLA compiles between two :func:`compile_events` counts that the persistent
    cache did not serve."""
    return (after["compiles"] - before["compiles"]) - (after["cache_hits"] - before["cache_hits"])


def compiled_functions() -> dict[tuple[str, str], int]:
    """(kind, function name) -> count so far: what a difference of
    :func:`compile_events` was."""
    _register()
    with _lock:
        return dict(_names)
