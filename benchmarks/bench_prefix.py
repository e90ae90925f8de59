"""Prefix caching: TTFT cold vs warm vs restored from the host tier, physical KV memory
with vs without the cache, hit rate vs KVCACHED_MAX_CACHED_TOKENS, and page-aware vs LRU
eviction.

Workloads (random-weight model, so only token counts matter):
* chat: one shared system prompt (2048 tokens) and varied user turns;
* multi-turn: conversations whose every turn re-sends the history;
* sweep: four system prompts (512 tokens) in random order, for the bound sweep.
Prints tables, writes JSON and a PNG plot to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from bench_common import BENCH_MODEL, load_model

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.prefix_cache import PrefixCache, hash_blocks
from jax_kvcached.engine.sampling import SamplingParams

MiB = 1 << 20
CFG = BENCH_MODEL


def _tokens(rng, n, vocab=CFG.vocab_size):
    return rng.integers(0, vocab, n).tolist()


def _engine(model, caching, bound=-1, limit="1GiB", batch=16, host_cache_tokens=0):
    pool = kv.Pool(limit, backend="host", min_reserved_pages=0, max_reserved_pages=0)
    eng = Engine(
        model,
        pool,
        max_batch=batch,
        max_num_batched_tokens=512,
        prefix_caching=caching,
        max_cached_tokens=bound,
        host_cache_tokens=host_cache_tokens,
    )
    return pool, eng


def ttft_cold_warm(model, system_len: int, reps: int) -> dict:
    """TTFT of a request whose ``system_len``-token prefix is computed (cold), found on
    the device (warm) or restored from the host tier after its eviction (host)."""
    rng = np.random.default_rng(0)
    pool, eng = _engine(model, True, host_cache_tokens=2 * system_len)
    v = model.config.vocab_size
    p = SamplingParams(max_tokens=1)

    def ttft(system):
        return eng.generate([system + _tokens(rng, 40, v)], p)[0].ttft_s

    def evict_to_host():
        eng.prefix_cache.evict(10**9)  # every idle block: copied to the host tier

    # Compile every path (cold prefill, prefill on top of cached blocks) on a throwaway
    # system prompt first.
    warm_sys = _tokens(rng, system_len, v)
    ttft(warm_sys), ttft(warm_sys), evict_to_host(), ttft(warm_sys)
    cold, warm, host = [], [], []
    for _ in range(reps):
        system = _tokens(rng, system_len, v)
        cold.append(ttft(system))
        warm.append(ttft(system))
        evict_to_host()
        restores = eng.kv.host_cache.restores
        host.append(ttft(system))
        assert eng.kv.host_cache.restores == restores + 1, "the prefix was not restored"
    hc = eng.stats()["host_cache"]
    pool.close()
    c, w, h = float(np.median(cold)), float(np.median(warm)), float(np.median(host))
    return {
        "system_tokens": system_len,
        "cold_ttft_ms": c * 1e3,
        "warm_ttft_ms": w * 1e3,
        "host_ttft_ms": h * 1e3,
        "cold_over_warm": c / w,
        "cold_over_host": c / h,
        "restored_mib_per_request": hc["bytes_from_host"] / hc["restores"] / MiB,
    }


def _print_ttft(name: str, t: dict) -> None:
    print(
        f"\n{name}: TTFT with a {t['system_tokens']}-token prefix: recomputed "
        f"{t['cold_ttft_ms']:.1f} ms, device hit {t['warm_ttft_ms']:.1f} ms, restored from "
        f"the host tier {t['host_ttft_ms']:.1f} ms ({t['restored_mib_per_request']:.1f} MiB "
        f"copied in)\n  recompute/device {t['cold_over_warm']:.1f}x (goal >= 10x), "
        f"recompute/host restore {t['cold_over_host']:.1f}x (goal >= 5x)"
    )


def chat_memory(model, system_len: int, users: int) -> dict:
    out = {}
    for caching in (False, True):
        rng = np.random.default_rng(1)
        system = _tokens(rng, system_len)
        pool, eng = _engine(model, caching, limit="2GiB", batch=users)
        peak = {"v": 0}

        def track(rid, tok, fin, pool=pool, peak=peak):
            peak["v"] = max(peak["v"], pool.stats()["mapped_bytes"])

        p = SamplingParams(max_tokens=16, ignore_eos=True)
        eng.generate([system + _tokens(rng, 48)], p, on_token=track)  # the first user
        outs = eng.generate(
            [system + _tokens(rng, int(rng.integers(16, 96))) for _ in range(users)],
            p,
            on_token=track,
        )
        out["with" if caching else "without"] = {
            "peak_mapped_mib": peak["v"] / MiB,
            "requests": len(outs) + 1,
            "hit_rate": (eng.stats()["prefix_cache"] or {}).get("hit_rate", 0.0),
        }
        pool.close()
    w, wo = out["with"]["peak_mapped_mib"], out["without"]["peak_mapped_mib"]
    out["memory_saving"] = 1 - w / wo
    return out


def multi_turn(model, turns: int, convs: int) -> dict:
    out = {}
    for caching in (False, True):
        rng = np.random.default_rng(2)
        pool, eng = _engine(model, caching, batch=convs)
        histories = [_tokens(rng, 200) for _ in range(convs)]
        per_turn = []
        for _ in range(turns):
            prompts = [h + _tokens(rng, 32) for h in histories]
            outs = eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
            per_turn.append(
                sum(len(pr) - o.cached_tokens for pr, o in zip(prompts, outs, strict=True))
            )
            histories = [pr + o.token_ids for pr, o in zip(prompts, outs, strict=True)]
        out["with" if caching else "without"] = {
            "prefill_tokens_per_turn": per_turn,
            "prefill_tokens_computed": sum(per_turn),
            "hit_rate": (eng.stats()["prefix_cache"] or {}).get("hit_rate", 0.0),
        }
        pool.close()
    return out


def bound_sweep(model, bounds, requests: int) -> list[dict]:
    rows = []
    for bound in bounds:
        rng = np.random.default_rng(3)
        systems = [_tokens(rng, 512) for _ in range(4)]
        pool, eng = _engine(model, True, bound=bound, batch=4)
        order = rng.integers(0, 4, requests)
        for i in range(0, requests, 4):
            eng.generate(
                [systems[j] + _tokens(rng, 20) for j in order[i : i + 4]],
                SamplingParams(max_tokens=2),
            )
        s = eng.prefix_cache.stats()
        rows.append(
            {
                "max_cached_tokens": bound,
                "hit_rate": s["hit_rate"],
                "cached_tokens": s["cached_tokens"],
                "evictions": s["evictions"],
            }
        )
        pool.close()
    return rows


def eviction_stride8() -> dict:
    """kvcached's stride-8 case with 2 MiB pages: idle cached blocks of 2048 requests (8
    blocks each) with LRU order running across pages; evict half of them both ways."""
    out = {}
    for page_aware in (False, True):
        pool = kv.Pool("2GiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
        c = pool.create_kv_cache("stride8", 1, 8, 128, "bfloat16", block_size=16)
        pc = PrefixCache(c, -1)
        seqs = []
        for i in range(2048):  # 2048 requests x 8 blocks, allocated request after request
            toks = [i] * (16 * 8)
            hs = hash_blocks(toks, 16, b"")
            blocks = pc.pool.alloc(8)
            for h, b in zip(hs, blocks, strict=True):
                pc.insert(h, b)
            seqs.append(blocks)
        for s in seqs:
            pc.pool.free_blocks(s)
        for blocks in zip(*seqs, strict=True):  # LRU age in stride order (8 apart)
            for b in blocks:
                pc.policy.touch(b)
        before = pool.stats()["mapped_bytes"]
        n = pc.num_evictable_blocks // 2
        pc.evict(n, page_aware=page_aware)
        out["page_aware" if page_aware else "lru"] = {
            "evicted_blocks": n,
            "freed_gb": (before - pool.stats()["mapped_bytes"]) / 1e9,
        }
        pool.close()
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    sweep = result["bound_sweep"]
    labels = [
        "unlimited" if r["max_cached_tokens"] < 0 else str(r["max_cached_tokens"]) for r in sweep
    ]
    ax[0].bar(labels, [100 * r["hit_rate"] for r in sweep])
    ax[0].set(
        title="hit rate vs KVCACHED_MAX_CACHED_TOKENS",
        ylabel="hit rate (%)",
        xlabel="max cached tokens",
    )
    mem = result["chat_memory"]
    ax[1].bar(
        ["without", "with"], [mem["without"]["peak_mapped_mib"], mem["with"]["peak_mapped_mib"]]
    )
    ax[1].set(
        title=f"chat: peak physical KV ({100 * mem['memory_saving']:.0f}% less)", ylabel="MiB"
    )
    mt = result["multi_turn"]
    for k in ("without", "with"):
        turns = mt[k]["prefill_tokens_per_turn"]
        ax[2].plot(range(1, len(turns) + 1), turns, marker="o", label=f"{k} prefix cache")
    ax[2].set(title="multi-turn: prefill tokens computed", xlabel="turn", ylabel="tokens")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.join(os.path.dirname(__file__), "results")
    p.add_argument("--out", default=os.path.join(here, "bench_prefix.json"))
    p.add_argument("--quick", action="store_true", help="smaller workloads")
    p.add_argument(
        "--model", default="bench",
        help="bench (random, small; every section) or smollm2-135m (TTFT only: the other "
        "sections measure memory and hit rates, which do not depend on the weights)",
    )  # fmt: skip
    args = p.parse_args()
    model = load_model(args.model)
    t0 = time.perf_counter()
    q = args.quick
    if args.model != "bench":
        t = ttft_cold_warm(model, 2048, 2 if q else 3)
        _print_ttft(args.model, t)
        out = os.path.join(os.path.dirname(args.out), f"bench_prefix_{args.model}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"model": args.model, "ttft": t}, f, indent=2)
        print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
        return
    result = {
        "ttft": ttft_cold_warm(model, 2048, 2 if q else 3),
        "chat_memory": chat_memory(model, 2048, 4 if q else 12),
        "multi_turn": multi_turn(model, 3 if q else 5, 4),
        "bound_sweep": bound_sweep(model, [0, 256, 512, 1024, 2048, -1], 16 if q else 32),
        "eviction_stride8": eviction_stride8(),
    }
    _print_ttft("bench model", result["ttft"])
    m = result["chat_memory"]
    print(
        f"chat, shared 2048-token system prompt: peak physical KV "
        f"{m['without']['peak_mapped_mib']:.0f} MiB without vs {m['with']['peak_mapped_mib']:.0f}"
        f" MiB with prefix caching ({100 * m['memory_saving']:.0f}% less, "
        f"{m['with']['requests']} requests)"
    )
    mt = result["multi_turn"]
    print(
        f"multi-turn: prefill tokens computed {mt['without']['prefill_tokens_computed']} without"
        f" vs {mt['with']['prefill_tokens_computed']} with (hit rate "
        f"{100 * mt['with']['hit_rate']:.0f}%); per turn without "
        f"{mt['without']['prefill_tokens_per_turn']}, with {mt['with']['prefill_tokens_per_turn']}"
    )
    print("hit rate vs KVCACHED_MAX_CACHED_TOKENS (4 system prompts x 512 tokens, random order)")
    for r in result["bound_sweep"]:
        print(
            f"  {r['max_cached_tokens']:>6}: hit rate {100 * r['hit_rate']:5.1f}%, "
            f"{r['evictions']} evictions"
        )
    e = result["eviction_stride8"]
    print(
        f"stride-8 eviction of {e['lru']['evicted_blocks']} blocks: LRU freed "
        f"{e['lru']['freed_gb']:.2f} GB, page-aware {e['page_aware']['freed_gb']:.2f} GB"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(result, png)
    print(f"\nwrote {args.out} and {png} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
