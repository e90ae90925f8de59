"""Shared by the benchmarks: the benchmark model and the timer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_kvcached.models import ModelConfig

# A small decoder where attention over the KV cache is a real share of the step.
BENCH_MODEL = ModelConfig(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=8192,
)


def load_model(name: str) -> Any:
    """``bench`` (the random BENCH_MODEL) or a packaged trained model (``smollm2-135m``,
    fp32: the CPU's fast path)."""
    import jax.numpy as jnp

    from jax_kvcached.models import build_model, load_pretrained

    if name == "bench":
        return build_model(BENCH_MODEL, seed=0)
    return load_pretrained(name, dtype=jnp.float32).model


def median_time(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    """Median seconds of ``fn()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))
