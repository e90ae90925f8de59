"""What structured outputs cost, side by side in one run, on SmolLM2-135M (its packed
Q4_1 GGUF and its 49,152-token BPE vocabulary).

``grammar``: the host's work per token of a JSON-schema output, llguidance's mask of the
next token plus taking the sampled one, timed over a valid document's tokens (the
XGrammar paper's figure for JSON schemas: under 40 us a token). ``engine``: decode
throughput of ``--batch`` requests of ``--tokens`` tokens each, free text against the
same requests held to a regular expression (lower-case words, longer than the output:
every token masked), interleaved rounds, medians. A
constrained step waits for its previous step's tokens (its mask needs them), so it loses
the overlap of host and device work; the ratio shows what that costs. Writes
benchmarks/results/bench_structured.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.structured import GrammarCompiler, Structured
from jax_kvcached.models import load_pretrained

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags", "address"],
}  # fmt: skip
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
       "address": {"city": "London", "zip": "W1"}}  # fmt: skip


def bench_grammar(pre, rounds: int) -> dict:
    tok, cfg = pre.tokenizer, pre.model.config
    compiler = GrammarCompiler(tok, cfg.vocab_size, cfg.eos_ids)
    spec = Structured("json", json.dumps(SCHEMA), compact=True)
    t0 = time.perf_counter()
    compiler.compile(spec)
    compile_s = time.perf_counter() - t0
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    per_token = []
    for _ in range(rounds):
        state = compiler.state(spec)
        t0 = time.perf_counter()
        for t in ids:
            state.mask()
            if not state.accept(t):
                raise RuntimeError(f"the document's token {t} is refused")
        per_token.append((time.perf_counter() - t0) / len(ids))
    return {"tokens": len(ids), "compile_ms": compile_s * 1e3,
            "us_per_token": float(np.median(per_token)) * 1e6}  # fmt: skip


def bench_engine(pre, batch: int, tokens: int, rounds: int) -> dict:
    pool = kv.Pool("1GiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    eng = Engine(pre.model, pool, max_batch=batch, max_num_batched_tokens=256,
                 max_model_len=1024, tokenizer=pre.tokenizer)  # fmt: skip
    eng.compile()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, 32).tolist() for _ in range(batch)]
    # lower-case words, longer than any run writes: every request decodes ``tokens``
    spec = Structured("regex", "[a-z ]{4000}")
    variants = {
        "free": SamplingParams(max_tokens=tokens, temperature=0.8, ignore_eos=True, seed=1),
        "regex": SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, structured=spec),
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in variants}
    counts: dict[str, list[int]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, p in variants.items():
            t0 = time.perf_counter()
            outs = eng.generate(prompts, [p] * batch)
            times[name].append(time.perf_counter() - t0)
            counts[name].append(sum(len(o.token_ids) for o in outs))
            eng.reset_prefix_cache()
    out = {}
    for name in variants:
        n = int(np.median(counts[name]))
        out[name] = {"tokens": n, "tok_s": n / float(np.median(times[name]))}
    out["regex_vs_free"] = out["regex"]["tok_s"] / out["free"]["tok_s"]
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="grammar,engine")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    pre = load_pretrained("smollm2-135m")
    result: dict = {"model": "smollm2-135m (Q4_1 packed)", "cpus": os.cpu_count()}
    if "grammar" in args.parts:
        result["grammar"] = g = bench_grammar(pre, max(args.rounds, 5))
        print(f"grammar: compile {g['compile_ms']:.1f} ms, {g['us_per_token']:.1f} us a "
              f"token over {g['tokens']} tokens (mask + accept)")  # fmt: skip
    if "engine" in args.parts:
        result["engine"] = e = bench_engine(pre, args.batch, args.tokens, args.rounds)
        result["engine"].update(batch=args.batch, max_tokens=args.tokens)
        print(f"engine, batch {args.batch}: free {e['free']['tok_s']:.1f} tok/s, regex "
              f"{e['regex']['tok_s']:.1f} tok/s ({e['regex_vs_free']:.2f}x)")
    path = os.path.join(os.path.dirname(__file__), "results", "bench_structured.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
