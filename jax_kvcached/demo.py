"""The main job (`jax-kvcached demo`): the embedded SmolLM2-135M-Instruct (or a tiny
random preset) answers a batch of chat prompts through a pool, with continuous batching;
prints the answers, tokens/s, TTFT, prefix-cache hits and memory."""

from __future__ import annotations

import time

import numpy as np

from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory.pool import Pool
from jax_kvcached.progress import Log

MiB = 1 << 20

CHATS = [
    "What is the capital of France?",
    "Write a haiku about virtual memory.",
    "Give me three tips for writing clear code.",
    "Why is the sky blue? Answer in one sentence.",
]

PROMPTS = [
    "The quick brown fox",
    "Virtual memory lets a KV cache",
    "Once upon a time, in a data center far away,",
    "def fibonacci(n):",
    "JAX is",
    "Paged attention reads blocks through a table",
    "Hello",
    "Elastic memory for several models on one device means",
]


def run_demo(
    model_name: str = "smollm2-135m",
    memory_limit: str = "256MiB",
    max_tokens: int = 48,
    batch: int = 8,
    temperature: float = 0.0,
    backend: str = "auto",
    seed: int = 0,
    quiet: bool = False,
) -> dict:
    import jax.numpy as jnp

    from jax_kvcached.models import (
        BUILTIN_CONFIGS,
        PRETRAINED,
        fetch,
        load_pretrained,
        weights_dtype,
    )

    log = Log(quiet)
    if model_name not in BUILTIN_CONFIGS and model_name not in PRETRAINED:
        raise ValueError(
            f"unknown model {model_name!r}; have {sorted(PRETRAINED) + sorted(BUILTIN_CONFIGS)}"
        )
    pool = Pool(memory_limit, backend=backend)
    try:
        if model_name in BUILTIN_CONFIGS:
            pre = load_pretrained(model_name, seed=seed)
            what = "random weights"
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
            shown: list = prompts
            ignore_eos = True
        else:
            # the dtype the pool's device computes well: fp32 on a CPU, bf16 on a GPU
            dtype = weights_dtype(model_name, pool.device)
            path = fetch(model_name, log=log)
            log(f"loading {model_name} from {path}...")
            pre = load_pretrained(model_name, dtype=dtype)
            what = f"trained, {jnp.dtype(dtype).name}"
            chats = shown = [CHATS[i % len(CHATS)] for i in range(batch)]
            prompts = [
                pre.tokenizer.encode(pre.template.render([{"role": "user", "content": c}]),
                                     add_special_tokens=False)
                for c in chats
            ]  # fmt: skip
            ignore_eos = False
    except BaseException:
        pool.close()
        raise
    cfg, model, tokenizer = pre.config, pre.model, pre.tokenizer
    engine = Engine(model, pool, name=model_name, max_batch=batch, tokenizer=tokenizer)
    log(
        f"jax-kvcached demo: {model_name} ({cfg.num_layers} layers, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} KV heads, {what}) on {pool.backend} ({pool.device}), "
        f"budget {pool.memory_limit / MiB:.0f} MiB"
    )
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=ignore_eos
        )
        for i in range(batch)
    ]
    # Warm-up compiles the step shapes (cold, then with the prompts' prefixes cached), so
    # the timed run below is steady state.
    log("compiling the step buckets...")
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    engine.generate(prompts, params)
    log(f"  done in {time.perf_counter() - t0:.1f} s")

    total = batch * max_tokens  # at most: a request may stop early
    state = {"done": 0, "peak": 0}

    def on_token(rid: int, tok: int, finished: bool) -> None:
        state["done"] += 1
        state["peak"] = max(state["peak"], pool.stats()["mapped_bytes"])
        log.progress("generating", state["done"], total, unit="tokens")

    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, on_token=on_token)
    elapsed = time.perf_counter() - t0
    ttft = np.array([o.ttft_s for o in outs]) * 1e3
    tokens = sum(len(o.token_ids) for o in outs)
    stats = pool.stats()
    cached = engine.stats()["prefix_cache"]
    # Every request finished: only idle prefix-cache blocks may still hold pages.
    engine.reset_prefix_cache()
    after_reset = pool.stats()["mapped_bytes"]
    result = {
        "model": model_name,
        "requests": len(outs),
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_max": float(ttft.max()),
        "peak_mapped_mib": state["peak"] / MiB,
        "mapped_after_mib": stats["mapped_bytes"] / MiB,
        "prefix_cached_blocks": cached["cached_blocks"] if cached else 0,
        "prefix_hit_rate": cached["hit_rate"] if cached else 0.0,
        "mapped_after_reset_mib": after_reset / MiB,
        "reserved_after_mib": stats["reserved_bytes"] / MiB,
        "steps": engine.steps,
        "compiled_shapes": engine.num_compiled,
        "outputs": [o.text for o in outs],
    }
    for p, o in list(zip(shown, outs, strict=True))[: min(4, batch)]:
        log(f"  {p!r} -> {o.text!r}")
    log(
        f"\n{tokens} tokens in {elapsed:.2f} s: {result['tokens_per_s']:.0f} tokens/s, "
        f"TTFT p50 {result['ttft_ms_p50']:.1f} ms (max {result['ttft_ms_max']:.1f} ms)"
    )
    log(
        f"pool: peak mapped {result['peak_mapped_mib']:.1f} MiB of "
        f"{pool.memory_limit / MiB:.0f} MiB; after the run mapped "
        f"{result['mapped_after_mib']:.1f} MiB (prefix cache: {result['prefix_cached_blocks']} "
        f"blocks, hit rate {100 * result['prefix_hit_rate']:.0f}%), reserved "
        f"{result['reserved_after_mib']:.1f} MiB; after a prefix-cache reset mapped "
        f"{result['mapped_after_reset_mib']:.1f} MiB"
    )
    pool.close()
    return result
