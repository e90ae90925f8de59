"""Recurrent state (Gated DeltaNet, Mamba2) in the elastic pool: memory per sequence,
TTFT with a restored state checkpoint, decode speed, each against attention.

* ``memory``: Qwen3-Next-80B-A3B's shape (48 layers: 12 gated attention, 2 KV heads of
  256; 36 Gated DeltaNet, 16 key heads and 32 value heads of 128, a 4-tap conv; bf16,
  16-token blocks, 2 MiB pages), 4 sequences of 1k / 8k / 32k tokens given their blocks
  by the KV manager (the engine's own), the pool's mapped bytes over 4: the hybrid cache
  (an attention group and a recurrent group) against the all-attention cache of the
  same 48 layers. The recurrent group's bytes per sequence stay flat.
* ``ttft``: ``tiny-qwen3-next`` through the Engine, a 2048-token prompt whose first 2032
  tokens are cached (the state restored from the checkpoint at 2032: 16 tokens
  prefilled) against a cold one of the same length; medians of ``--rounds``.
* ``decode``: greedy decode tokens/s at batch 1 and 32 (the prefill's time taken out),
  ``tiny-qwen3-next`` against the same model with gated attention on every layer
  (``all-attention``).

Prints a table and writes ``benchmarks/results/bench_recurrent.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.kv_groups import kv_cache_groups
from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.recurrent import slot_blocks
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.models.gated_deltanet import LinearAttentionConfig
from jax_kvcached.models.interface import FULL, RECURRENT, KVSpec

# Qwen3-Next-80B-A3B's cache geometry (transformers' Qwen3NextConfig defaults).
NEXT = dict(layers=48, every=4, kv_heads=2, head_dim=256,
            linear=LinearAttentionConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128,
                                         head_v_dim=128, conv_kernel=4))  # fmt: skip


def _mapped(specs: tuple[KVSpec, ...], tokens: int, state_elems: int, seqs: int = 4) -> dict:
    """Mapped bytes per group of a ``tokens``-token sequence in a cache of ``specs``:
    ``seqs`` of them given their blocks, the mapped bytes divided by ``seqs`` (so one
    sequence's partly filled last pages weigh little)."""
    layer_groups, group_specs = kv_cache_groups(specs)
    pool = kv.Pool("16GiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    cache = pool.create_kv_cache("m", len(specs), NEXT["kv_heads"], NEXT["head_dim"],
                                 "bfloat16", 16, layer_groups=layer_groups)  # fmt: skip
    slots = slot_blocks(cache, state_elems) if RECURRENT in group_specs else 0
    mgr = KVManager(cache, tokens + 16, prefix_caching=False, specs=group_specs,
                    slot_blocks=slots)  # fmt: skip
    held = []
    for i in range(seqs):
        seq = Sequence(i, [1] * tokens, SamplingParams(max_tokens=1))
        assert mgr.admit(seq) is not None and mgr.grow(seq, tokens)
        held.append(seq)
    out = {("recurrent" if s == RECURRENT else "attention"): g.mapped_bytes / seqs
           for g, s in zip(cache.groups, group_specs, strict=True)}  # fmt: skip
    out["total"] = cache.mapped_bytes / seqs
    out["slot_blocks"] = slots
    for seq in held:
        mgr.release(seq)
    cache.close()
    pool.close()
    return out


def bench_memory(contexts: list[int]) -> dict:
    lin = NEXT["linear"]
    hybrid = tuple(FULL if (i + 1) % NEXT["every"] == 0 else RECURRENT
                   for i in range(NEXT["layers"]))  # fmt: skip
    dense = (FULL,) * NEXT["layers"]
    out = {"state_values_per_layer": lin.state_elems, "rows": []}
    for n in contexts:
        h, d = _mapped(hybrid, n, lin.state_elems), _mapped(dense, n, 0)
        out["rows"].append({"tokens": n, "hybrid": h, "all_attention": d,
                            "ratio": h["total"] / d["total"]})  # fmt: skip
    return out


def _all_attention(cfg):
    return dataclasses.replace(cfg, linear=None, layer_types=None)


def _ttft(eng, prompt: list[int]) -> float:
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    while eng.has_work:
        for s in eng.step():
            if s.request_id == rid:
                return time.perf_counter() - t0
    raise RuntimeError("no first token")


def bench_ttft(rounds: int, tokens: int = 2048) -> dict:
    """A cached 2032-token prefix (state restored at its checkpoint) against cold."""
    cfg = BUILTIN_CONFIGS["tiny-qwen3-next"]
    pool = kv.Pool("1GiB", backend="host")
    eng = Engine(build_model(cfg, seed=0), pool, max_batch=4, max_model_len=4096)
    runs: dict = {"cold": [], "cached": []}
    for r in range(rounds + 1):  # (round 0 compiles)
        base = [(r * 131 + 7 * j) % 250 + 1 for j in range(tokens)]
        cold = _ttft(eng, base)  # cold: nothing of it cached
        follow = base[:2032] + [(r + j) % 250 + 1 for j in range(tokens - 2032)]
        seq_t = _ttft(eng, follow)
        if r:
            runs["cold"].append(cold)
            runs["cached"].append(seq_t)
    stats = eng.kv.stats()
    eng.close()
    pool.close()
    med = {k: statistics.median(runs[k]) for k in ("cold", "cached")}
    return {"tokens": tokens, "cached_prefix": 2032, "median_s": med, "runs": runs,
            "speedup": med["cold"] / med["cached"], "prefix_stats": stats}  # fmt: skip


def _tok_s(eng, batch: int, tokens: int) -> float:
    """Decode tokens/s of ``batch`` sequences of 64-token prompts: the time of ``1 +
    tokens`` new tokens less that of 1 (the prefill and the first token)."""
    prompts = [[1 + (i * 7 + j) % 250 for j in range(64)] for i in range(batch)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    return batch * tokens / max(run(1 + tokens) - run(1), 1e-9)


def bench_decode(rounds: int, tokens: int = 32) -> dict:
    cfg = BUILTIN_CONFIGS["tiny-qwen3-next"]
    pool = kv.Pool("2GiB", backend="host")
    engines = {n: Engine(build_model(c, seed=0), pool, name=n, max_batch=32, max_model_len=256,
                         prefix_caching=False)
               for n, c in (("hybrid", cfg), ("all_attention", _all_attention(cfg)))}  # fmt: skip
    runs: dict = {n: {1: [], 32: []} for n in engines}
    for eng in engines.values():
        for b in (1, 32):
            _tok_s(eng, b, tokens)  # compiles every shape the timed runs take
    for _ in range(rounds):
        for b in (1, 32):
            for n, eng in engines.items():
                runs[n][b].append(_tok_s(eng, b, tokens))
    for eng in engines.values():
        eng.close()
    pool.close()
    med = {n: {b: statistics.median(v) for b, v in r.items()} for n, r in runs.items()}
    return {"tok_s": med, "runs": runs,
            "hybrid_over_attention": {b: med["hybrid"][b] / med["all_attention"][b]
                                      for b in (1, 32)}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--rounds", type=int, default=3)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "results", "bench_recurrent.json"))
    args = p.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    result = {"date": time.strftime("%Y-%m-%d"), "memory": bench_memory(contexts),
              "ttft": bench_ttft(args.rounds), "decode": bench_decode(args.rounds)}  # fmt: skip
    m = result["memory"]
    print("Qwen3-Next-80B shape, bf16, MiB mapped per sequence (4 sequences):")
    print(f"{'tokens':>7s} {'hybrid attn':>12s} {'hybrid state':>13s} {'hybrid':>8s} "
          f"{'all-attn':>9s} {'ratio':>6s}")  # fmt: skip
    mib = 2**20
    for r in m["rows"]:
        h = r["hybrid"]
        print(f"{r['tokens']:7d} {h['attention'] / mib:12.1f} {h['recurrent'] / mib:13.1f} "
              f"{h['total'] / mib:8.1f} {r['all_attention']['total'] / mib:9.1f} "
              f"{r['ratio']:6.3f}")  # fmt: skip
    t = result["ttft"]
    print(f"\ntiny-qwen3-next TTFT, {t['tokens']}-token prompt: cold "
          f"{t['median_s']['cold'] * 1e3:.1f} ms, {t['cached_prefix']} cached "
          f"{t['median_s']['cached'] * 1e3:.1f} ms: {t['speedup']:.1f}x")  # fmt: skip
    d = result["decode"]
    print("\ntiny-qwen3-next decode (tok/s, median): batch  hybrid  all-attention  ratio")
    for b in (1, 32):
        print(f"{b:46d} {d['tok_s']['hybrid'][b]:7.0f} {d['tok_s']['all_attention'][b]:14.0f} "
              f"{d['hybrid_over_attention'][b]:6.2f}")  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
