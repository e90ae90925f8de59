"""Latent attention (MLA): KV bytes per token against the MHA cache of the same model.

Two measurements, each read from the pool's mapped bytes (not computed):

* ``pool``: DeepSeek-V3's shape (61 layers, 128 heads, qk 128 + 64, v 128, latent 512 +
  64, bf16). For 8192 tokens, a latent cache (one plane of 576 per layer) and the MHA
  cache the same model would need unabsorbed (K and V planes of 128 heads x 192: one
  cache's K and V share a width, V padded to K's), over ``--layers`` layers (the ratio
  per layer is the whole model's), scaled to 61 layers. The issue's formula (K and V of
  128 heads x 128) is printed beside them.
* ``engine``: the ``tiny-deepseek-v3`` preset through the Engine, one ``--tokens``-token
  prompt kept in the prefix cache, against the same preset with MLA replaced by MHA of its
  heads (4 x 24, K and V): mapped bytes after the run.
* ``decode``: the same two models' greedy decode tokens/s at batch 1 and 32 (what the
  absorbed form costs or saves on this CPU).

Prints a table and writes ``benchmarks/results/bench_mla.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model

V3 = dict(layers=61, heads=128, nope=128, rope=64, v=128, latent=512 + 64, itemsize=2)


def bench_pool(tokens: int, layers: int) -> dict:
    """Mapped bytes of ``tokens`` tokens in each cache (``layers`` layers), per token
    over the whole model."""
    s = V3
    pool = kv.Pool("8GiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    bs = 16
    caches = {
        "mla": pool.create_kv_cache("mla", layers, 1, s["latent"], "bfloat16", bs, latent=True),
        "mha": pool.create_kv_cache("mha", layers, s["heads"], s["nope"] + s["rope"],
                                    "bfloat16", bs),  # fmt: skip
    }
    out = {}
    for name, c in caches.items():
        ids = c.alloc(-(-tokens // bs))
        out[name] = c.mapped_bytes / tokens / layers * s["layers"]  # bytes a token, 61 layers
        c.free(ids)
    pool.close()
    formula = {
        "mla": s["layers"] * s["latent"] * s["itemsize"],
        "mha_k192_v192": s["layers"] * 2 * s["heads"] * (s["nope"] + s["rope"]) * s["itemsize"],
        "mha_issue_2x128x128": s["layers"] * 2 * s["heads"] * 128 * s["itemsize"],
    }
    return {"tokens": tokens, "layers_measured": layers, "measured_bytes_per_token": out,
            "formula_bytes_per_token": formula,
            "ratio_measured": out["mla"] / out["mha"],
            "ratio_formula_issue": formula["mla"] / formula["mha_issue_2x128x128"]}  # fmt: skip


def bench_engine(tokens: int) -> dict:
    """The tiny preset's mapped bytes after one prompt (kept in the prefix cache), MLA
    against the same model with MHA of its heads."""
    mla = BUILTIN_CONFIGS["tiny-deepseek-v3"]
    m = mla.mla
    mha = dataclasses.replace(mla, mla=None, num_kv_heads=mla.num_heads,
                              head_dim=m.qk_head_dim)  # fmt: skip
    out = {}
    for name, cfg in (("mla", mla), ("mha", mha)):
        pool = kv.Pool("256MiB", page_size="64KiB", backend="host", min_reserved_pages=0,
                       max_reserved_pages=0)  # fmt: skip
        eng = Engine(build_model(cfg, seed=0), pool, max_batch=1, max_num_batched_tokens=256)
        eng.generate([[1 + i % 300 for i in range(tokens)]], SamplingParams(max_tokens=1))
        out[name] = {"mapped_bytes": eng.cache.mapped_bytes,
                     "cached_blocks": eng.prefix_cache.num_cached_blocks,
                     "block_bytes_all_layers": eng.cache.block_bytes
                     * eng.cache.pages_per_kv_page}  # fmt: skip
        eng.close()
        pool.close()
    out["ratio"] = out["mla"]["mapped_bytes"] / out["mha"]["mapped_bytes"]
    out["ratio_formula"] = m.latent_dim / (2 * mla.num_heads * m.qk_head_dim)
    return out


def _tok_s(eng, batch: int, tokens: int = 32) -> float:
    """Decode tokens/s of ``batch`` sequences (8-token prompts, ``tokens`` new each)."""
    prompts = [[1 + (i * 7 + j) % 300 for j in range(8)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    eng.generate(prompts, params)
    return batch * tokens / (time.perf_counter() - t0)


def bench_decode(rounds: int) -> dict:
    """Greedy decode at batch 1 and 32: the tiny preset's absorbed MLA against the same
    model with MHA of its heads, alternating, medians of ``rounds``."""
    import statistics

    mla = BUILTIN_CONFIGS["tiny-deepseek-v3"]
    mha = dataclasses.replace(mla, mla=None, num_kv_heads=mla.num_heads,
                              head_dim=mla.mla.qk_head_dim)  # fmt: skip
    pool = kv.Pool("1GiB", backend="host")
    engines = {n: Engine(build_model(c, seed=0), pool, name=n, max_batch=32, max_model_len=128)
               for n, c in (("mla", mla), ("mha", mha))}  # fmt: skip
    runs: dict = {n: {1: [], 32: []} for n in engines}
    for eng in engines.values():
        for b in (1, 32):
            _tok_s(eng, b, 4)  # compile
    for _ in range(rounds):
        for b in (1, 32):
            for n, eng in engines.items():
                runs[n][b].append(_tok_s(eng, b))
    for eng in engines.values():
        eng.close()
    pool.close()
    med = {n: {b: statistics.median(v) for b, v in r.items()} for n, r in runs.items()}
    return {"tok_s": med, "runs": runs,
            "mla_over_mha_tok_s": {b: med["mla"][b] / med["mha"][b] for b in (1, 32)}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--engine-tokens", type=int, default=960)
    p.add_argument("--rounds", type=int, default=3)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "results", "bench_mla.json"))
    args = p.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "pool": bench_pool(args.tokens, args.layers),
              "engine": bench_engine(args.engine_tokens),
              "decode": bench_decode(args.rounds)}  # fmt: skip
    r = result["pool"]
    print(f"DeepSeek-V3 shape, bf16, {args.tokens} tokens, bytes a token (61 layers):")
    print(f"{'cache':28s} {'measured':>12s} {'formula':>12s}")
    f, m = r["formula_bytes_per_token"], r["measured_bytes_per_token"]
    print(f"{'MLA latent (576)':28s} {m['mla']:12.0f} {f['mla']:12d}")
    print(f"{'MHA K+V 128 x 192':28s} {m['mha']:12.0f} {f['mha_k192_v192']:12d}")
    print(f"{'MHA K+V 128 x 128 (issue)':28s} {'':>12s} {f['mha_issue_2x128x128']:12d}")
    print(f"ratio MLA / MHA measured: 1/{1 / r['ratio_measured']:.1f}; "
          f"issue's formula: 1/{1 / r['ratio_formula_issue']:.1f}")  # fmt: skip
    e = result["engine"]
    print(f"\ntiny-deepseek-v3, {args.engine_tokens}-token prompt through the Engine: "
          f"MLA {e['mla']['mapped_bytes']} B vs MHA {e['mha']['mapped_bytes']} B mapped, "
          f"1/{1 / e['ratio']:.2f} (formula 1/{1 / e['ratio_formula']:.2f})")  # fmt: skip
    d = result["decode"]
    print("\ntiny-deepseek-v3 decode (tok/s, median): batch   MLA   MHA   MLA/MHA")
    for b in (1, 32):
        print(f"{b:47d} {d['tok_s']['mla'][b]:5.0f} {d['tok_s']['mha'][b]:5.0f} "
              f"{d['mla_over_mha_tok_s'][b]:6.2f}")  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
