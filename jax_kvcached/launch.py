"""``jax-kvcached serve``: builds the models' engines on one pool and runs the server."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

from jax_kvcached.chat_template import ChatTemplate
from jax_kvcached.config import parse_bytes
from jax_kvcached.engine import Engine
from jax_kvcached.pool import Pool
from jax_kvcached.sampling import SamplingParams
from jax_kvcached.server import AuthConfig, ServedModel

log = logging.getLogger("jax_kvcached.serve")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # a built-in preset or a checkpoint directory
    limit: int | str | None = None
    guarantee: int | str = 0


def parse_pairs(items: list[str], what: str) -> dict[str, str]:
    """``["a=x", "b=y"]`` -> ``{"a": "x", "b": "y"}``; ValueError on a bad item."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{what} must look like NAME=VALUE, got {item!r}")
        if name in out:
            raise ValueError(f"{what}: {name!r} is given twice")
        out[name] = value
    return out


def parse_specs(models: list[str], limits: list[str], guarantees: list[str]) -> list[ModelSpec]:
    srcs = parse_pairs(models, "--model")
    lims, gs = parse_pairs(limits, "--limit"), parse_pairs(guarantees, "--guarantee")
    for what, d in (("--limit", lims), ("--guarantee", gs)):
        for name, v in d.items():
            if name not in srcs:
                raise ValueError(f"{what} names {name!r}, which is not a --model")
            parse_bytes(v, what, allow_zero=True)
    return [ModelSpec(n, s, lims.get(n), gs.get(n, 0)) for n, s in srcs.items()]


def build_served(
    spec: ModelSpec,
    pool: Pool,
    *,
    max_batch: int,
    seed: int,
    dtype: object = None,
    **engine_kw: object,
) -> ServedModel:
    """An engine for a packaged model (``smollm2-135m``), a built-in random preset, a GGUF
    file or a local Hugging Face checkpoint folder."""
    from jax_kvcached.models import (
        BUILTIN_CONFIGS,
        PRETRAINED,
        ByteTokenizer,
        build_model,
        load_pretrained,
    )

    if spec.source in BUILTIN_CONFIGS:
        model = build_model(BUILTIN_CONFIGS[spec.source], seed=seed)
        tokenizer, template = ByteTokenizer(), ChatTemplate()
    elif spec.source in PRETRAINED or os.path.exists(spec.source):
        pre = load_pretrained(spec.source, dtype=dtype)
        model, tokenizer = pre.model, pre.tokenizer
        template = ChatTemplate.from_source(pre.chat_template, pre.special_tokens, pre.path)
    else:
        raise ValueError(
            f"--model {spec.name}={spec.source}: neither a packaged model "
            f"({', '.join(sorted(PRETRAINED))}), a built-in random one "
            f"({', '.join(sorted(BUILTIN_CONFIGS))}), a .gguf file nor a checkpoint directory"
        )
    engine = Engine(
        model, pool, name=spec.name, max_batch=max_batch, tokenizer=tokenizer,
        memory_limit=spec.limit, memory_guarantee=spec.guarantee, **engine_kw,
    )  # fmt: skip
    return ServedModel(engine, tokenizer, template)


def warm_up(served: ServedModel) -> float:
    """Compiles the common step shapes (short and long prompts, each power-of-two batch)
    before the server accepts requests; new shapes compile on first use."""
    t0 = time.perf_counter()
    eng = served.engine
    batches = [b for b in (1, 2, 4, 8, 16, 32) if b <= eng.scheduler.max_batch]
    for n in (8, 100):
        for b in batches:
            ps = [[1 + (i + j) % 200 for i in range(n)] for j in range(b)]
            eng.generate(ps, SamplingParams(max_tokens=3))
    if eng.prefix_cache:
        eng.prefix_cache.reset(after=eng.runner.token)
    return time.perf_counter() - t0


def serve(
    specs: list[ModelSpec],
    *,
    memory: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: str = "auto",
    page_size: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    max_cached_tokens: int | None = None,
    seed: int = 0,
    warmup: bool = True,
    auth: AuthConfig | None = None,
    shutdown_timeout: float = 10.0,
    max_body_bytes: int = 1 << 20,
) -> None:
    """Builds the engines and serves until SIGINT / SIGTERM. On the signal it stops
    accepting connections and requests, lets in-flight requests finish for up to
    ``shutdown_timeout`` seconds, cancels the rest (an error event each, blocks freed)
    and returns."""
    import uvicorn

    from jax_kvcached.server import create_app
    from jax_kvcached.serving import ServingLoop

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)  # type: ignore[arg-type]
            if first:
                log.info("shutting down: in-flight requests get %.1f s", shutdown_timeout)
                threading.Thread(
                    target=loop.shutdown, args=(shutdown_timeout,), daemon=True
                ).start()

    import jax.numpy as jnp

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    pool = Pool(memory, page_size=page_size, backend=backend)
    # Trained weights: bf16 on a GPU; fp32 on the CPU, where XLA emulates bf16 matmuls.
    dtype = jnp.bfloat16 if pool.backend == "cuda" else jnp.float32
    models: dict[str, ServedModel] = {}
    try:
        for i, spec in enumerate(specs):
            models[spec.name] = build_served(
                spec, pool, max_batch=max_batch, seed=seed + i, dtype=dtype,
                max_cached_tokens=max_cached_tokens,
            )  # fmt: skip
            if warmup:
                log.info("%s: compiled in %.1f s", spec.name, warm_up(models[spec.name]))
        loop = ServingLoop({n: m.engine for n, m in models.items()}, max_queue=max_queue)
        app = create_app(loop, models, pool, auth=auth, max_body_bytes=max_body_bytes)
        log.info(
            "serving %s on http://%s:%d (pool %s on %s)",
            ", ".join(models), host, port, memory, pool.backend,
        )  # fmt: skip
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning",
            timeout_graceful_shutdown=shutdown_timeout + 5,  # a backstop: the loop ends first
        )  # fmt: skip
        # uvicorn re-raises the signal it handled once it is done: make that a no-op so
        # a graceful shutdown exits 0.
        previous = {s: signal.signal(s, lambda *_: None) for s in _SIGNALS}
        try:
            with loop:
                GracefulServer(config).run()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    finally:
        pool.close()


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
