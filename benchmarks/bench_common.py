"""Shared by the benchmarks: the benchmark model and the timer."""

from __future__ import annotations

import json
import os
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


def architecture(name: str) -> ModelConfig:
    """A trained model's architecture (``architectures.json``, read off its GGUF), for
    timing without its weights (a machine the checkpoint cannot be carried to)."""
    path = os.path.join(os.path.dirname(__file__), "architectures.json")
    with open(path, encoding="utf-8") as f:
        known = json.load(f)
    if name not in known:
        raise ValueError(f"no architecture {name!r} in {path} (has {sorted(known)})")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in known[name].items()}
    return ModelConfig(**fields)


def load_model(name: str, dtype: str = "float32", quantization: str | None = "none") -> Any:
    """``bench`` (the random BENCH_MODEL), a packaged trained model (``smollm2-135m``,
    ``gemma3-270m``) or ``arch:NAME`` (that model's architecture, random weights: the
    same step time without the checkpoint), in ``dtype`` (default fp32: the CPU's fast
    path; bfloat16 on a GPU). ``quantization``: as ``load_pretrained`` takes it (default
    ``none``: full precision, a GGUF dequantized; None: a GGUF's packed weights;
    ``int8`` / ``int4``: packed at load)."""
    import jax.numpy as jnp

    from jax_kvcached.models import build_model, load_pretrained
    from jax_kvcached.models.loader import repack

    if name in ("bench",) or name.startswith("arch:"):
        cfg = BENCH_MODEL if name == "bench" else architecture(name[5:])
        return repack(build_model(cfg, seed=0, dtype=jnp.dtype(dtype)), cfg, quantization)
    return load_pretrained(name, dtype=jnp.dtype(dtype), quantization=quantization).model


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
