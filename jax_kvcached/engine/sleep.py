"""Sleep mode: an idle engine gives its device memory back and keeps its compiled steps.

Level 1 moves the weights to host memory (page-locked where the backend has a
``pinned_host`` memory, so waking is one bandwidth-bound copy per array); level 2 drops
them (waking reloads the checkpoint). The device arrays are deleted either way, and the
restored arrays have the same shapes, dtypes and shardings, committed like the runner's
own (it commits its weights when it is built: jit keys on commitment), so every
executable compiled before the sleep is hit again after the wake.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

@dataclasses.dataclass
class Offloaded:
    """What a sleeping engine holds of its weights."""

    level: int
    host: list[Any] | None  # level 1: host copies, in the runner's flat order
    shardings: list[Any]
    avals: list[jax.ShapeDtypeStruct]
    nbytes: int  # device bytes given back


def _pinned(sharding: Any) -> Any | None:
    """``sharding`` in page-locked host memory, if its device has such a memory."""
    try:
        kinds = {m.kind for d in sharding.device_set for m in d.addressable_memories()}
        if "pinned_host" not in kinds:
            return None
        return sharding.with_memory_kind("pinned_host")
    except (AttributeError, ValueError, RuntimeError):  # a backend without memory kinds
        return None


_said: set[str] = set()


def _on_gpu(w: jax.Array) -> bool:
    return any(d.platform in ("gpu", "cuda") for d in w.sharding.device_set)


def _say_pageable() -> None:
    """Once a process: a GPU without page-locked host memory (the wake is slower)."""
    if "pageable" not in _said:
        _said.add("pageable")
        log.warning("sleep: this GPU's backend offers no page-locked host memory; the "
                    "weights go to pageable memory (a slower wake)")  # fmt: skip


def offload(weights: list[jax.Array], level: int) -> Offloaded:
    """Copies the weights to host memory (level 1; level 2 keeps nothing) and deletes
    the device arrays."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (weights to host) or 2 (dropped), got {level!r}")
    shardings = [w.sharding for w in weights]
    avals = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
    host = None
    if level == 1:
        host = []
        for w in weights:
            target = _pinned(w.sharding)
            if target is None and _on_gpu(w):
                _say_pageable()
            # a copy on the host that survives the device array's deletion
            host.append(jax.device_put(w, target) if target is not None else np.array(w))
        for h in host:
            if isinstance(h, jax.Array):
                h.block_until_ready()
    nbytes = sum(int(w.nbytes) for w in weights)
    for w in weights:
        w.delete()
    return Offloaded(level, host, shardings, avals, nbytes)


def restore(off: Offloaded, fresh: list[Any] | None = None) -> tuple[list[jax.Array], float]:
    """The device weights again: from the host copies (level 1) or from ``fresh`` host or
    device arrays of a reload (level 2); returns them and the seconds the copy took."""
    source = off.host if off.level == 1 else fresh
    if source is None or len(source) != len(off.shardings):
        raise ValueError("waking needs the weights: a level-2 sleep reloads them")
    t0 = time.perf_counter()
    out = [jax.device_put(x, s) for x, s in zip(source, off.shardings, strict=True)]
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0
