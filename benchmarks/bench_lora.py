"""What LoRA adapters cost, side by side in one run, on SmolLM2-135M (its packed Q4_1
GGUF; the adapters stay float32, random, rank ``--rank`` on q, k, v, o, gate, up and
down; every figure a median of interleaved rounds).

``overhead``: two engines of the same weights in one pool, one without adapter slots,
one with ``--max-loras`` slots holding as many adapters, decode at ``--concurrency``:
``base_rows`` (every row on the base: goal nothing measurable, the base-only rows sort
past the adapters' groups and are not multiplied), ``adapter_rows`` (every row on an
adapter), ``mixed_rows`` (half and half); an adapter's load time and the programs
loading and unloading compiled after warm-up (goal: none).

``distinct``: a batch of 32 requests over 1, 8 and 32 distinct adapters (32 slots)
against the base alone (goal: 8 distinct at >= 0.8x).

``many``: ``--many`` adapters registered on one engine with 8 slots under a 1 GiB pool,
``--max-cpu-loras`` of them kept in host memory: each called twice, in two orders (the
second pass finds most adapters evicted and some read again from their folder); every
answer must equal the same adapter's other answer, and distinct adapters answer
differently. TTFT of a request whose adapter is cold (read from its folder and placed)
against warm (resident).

Writes benchmarks/results/bench_lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import load_pretrained

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(cfg, n: int, rank: int, folder: str) -> list[str]:
    """``n`` random PEFT LoRA adapters of SmolLM2's shapes (B scaled down: they steer
    the model without wrecking it)."""
    import peft
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        tie_word_embeddings=True,
    )  # fmt: skip
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM(hf_cfg),
            peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                            init_lora_weights=False),
        )  # fmt: skip
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data *= 0.05
        path = os.path.join(folder, f"adapter{i}")
        model.save_pretrained(path)
        paths.append(path)
    return paths


def decode_rate(eng: Engine, prompts: list[list[int]], adapters: list[str | None],
                tokens: int) -> float:  # fmt: skip
    """Generated tokens a second of one round (every request to ``tokens`` tokens)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, adapter=adapters)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def interleaved_medians(cases: dict[str, tuple[Engine, list[str | None]]],
                        prompts: list[list[int]], tokens: int, rounds: int) -> dict[str, float]:
    """Each case's median decode rate (``cases``: name -> (engine, each prompt's
    adapter)) over ``rounds`` rounds that take the cases in turn, after a warm-up round
    that meets every program and places every adapter."""
    for eng, ads in cases.values():
        decode_rate(eng, prompts, ads, 4)
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for key, (eng, ads) in cases.items():
            rates[key].append(decode_rate(eng, prompts, ads, tokens))
    return {k: statistics.median(v) for k, v in rates.items()}


def numpy_adapters(cfg, n: int, rank: int, folder: str) -> list[str]:
    """``n`` random PEFT-format adapters written with numpy alone (fast, for many)."""
    from safetensors.numpy import save_file

    from jax_kvcached.models.lora import projection_shapes

    shapes, paths = projection_shapes(cfg), []
    for i in range(n):
        rng, tensors = np.random.default_rng(1000 + i), {}
        for layer in range(cfg.num_layers):
            for t in TARGETS:
                fin, fout = shapes[t]
                part = "self_attn" if t in TARGETS[:4] else "mlp"
                p = f"base_model.model.model.layers.{layer}.{part}.{t}"
                tensors[f"{p}.lora_A.weight"] = (rng.standard_normal((rank, fin)) /
                                                 np.sqrt(fin)).astype(np.float32)
                tensors[f"{p}.lora_B.weight"] = (rng.standard_normal((fout, rank)) *
                                                 0.05).astype(np.float32)  # fmt: skip
        path = os.path.join(folder, f"many{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": TARGETS}, f)  # fmt: skip
        paths.append(path)
    return paths


def bench_overhead(pre, args, paths) -> dict:
    pool = kv.Pool("1GiB", backend="host")
    common = dict(max_batch=args.concurrency, max_model_len=512, tokenizer=pre.tokenizer)
    plain = Engine(pre.model, pool, name="plain", **common)
    lora = Engine(pre.model, pool, name="lora", max_loras=args.max_loras,
                  max_lora_rank=args.rank, **common)  # fmt: skip
    for eng in (plain, lora):
        eng.compile()
    load_ms = []
    for i, path in enumerate(paths):
        t0 = time.perf_counter()
        lora.load_adapter(f"a{i}", path)
        load_ms.append((time.perf_counter() - t0) * 1e3)
    prompts = [pre.tokenizer.encode(f"Story {i}: once upon a time") for i in
               range(args.concurrency)]  # fmt: skip
    n, names = args.concurrency, [f"a{i % args.max_loras}" for i in range(args.concurrency)]
    cases = {
        "plain": (plain, [None] * n),
        "base_rows": (lora, [None] * n),
        "adapter_rows": (lora, names),
        "mixed_rows": (lora, [a if i % 2 else None for i, a in enumerate(names)]),
    }
    med = interleaved_medians(cases, prompts, args.tokens, args.rounds)
    lora.unload_adapter("a0")  # loading and unloading after warm-up compiles nothing
    lora.load_adapter("a0", paths[-1])
    decode_rate(lora, prompts, names, 4)
    stats = lora.stats()["lora"]
    out = {
        "concurrency": n, "max_loras": args.max_loras,
        "decode_tok_s": med,
        "vs_plain": {k: med[k] / med["plain"] for k in cases if k != "plain"},
        "load": {"ms": statistics.median(load_ms), "adapter_bytes": stats["adapters"][0]["bytes"],
                 "slot_bytes": stats["slot_bytes"],
                 "compiles_after_warmup": lora.runner.compiles_after_warmup},
    }  # fmt: skip
    for eng in (plain, lora):
        eng.close()
    pool.close()
    return out


def bench_distinct(pre, args, paths) -> dict:
    """A batch of 32 over 1, 8 and 32 distinct adapters against the base alone."""
    pool = kv.Pool("2GiB", backend="host")
    common = dict(max_batch=32, max_model_len=256, tokenizer=pre.tokenizer)
    plain = Engine(pre.model, pool, name="plain", **common)
    lora = Engine(pre.model, pool, name="lora", max_loras=32, max_lora_rank=args.rank,
                  **common)  # fmt: skip
    for i, path in enumerate(paths[:32]):
        lora.load_adapter(f"d{i}", path)
    prompts = [pre.tokenizer.encode(f"Note {i}: the weather") for i in range(32)]
    cases = {"base": (plain, [None] * 32)}
    for k in (1, 8, 32):
        cases[f"{k}_adapters"] = (lora, [f"d{i % k}" for i in range(32)])
    med = interleaved_medians(cases, prompts, args.tokens, args.rounds)
    out = {"batch": 32, "decode_tok_s": med,
           "vs_base": {k: med[k] / med["base"] for k in cases if k != "base"}}  # fmt: skip
    for eng in (plain, lora):
        eng.close()
    pool.close()
    return out


def bench_many(pre, args, paths) -> dict:
    """``len(paths)`` adapters on 8 slots under a 1 GiB pool, each called twice."""
    pool = kv.Pool("1GiB", backend="host")
    eng = Engine(pre.model, pool, name="many", max_batch=8, max_model_len=256,
                 tokenizer=pre.tokenizer, max_loras=8, max_lora_rank=args.rank,
                 max_cpu_loras=args.max_cpu_loras)  # fmt: skip
    for i, path in enumerate(paths):
        eng.load_adapter(f"m{i}", path)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = pre.tokenizer.encode("The capital of France is")
    eng.generate(prompt, params)  # (warm)
    answers: dict[int, list[tuple[int, ...]]] = {i: [] for i in range(len(paths))}
    cold, warm = [], []
    order = list(range(len(paths)))
    for pass_ in range(2):
        for i in order:
            reads = eng.adapters.reads
            out = eng.generate(prompt, params, adapter=f"m{i}")[0]
            answers[i].append(tuple(out.token_ids))
            if pass_ == 1 and eng.adapters.reads > reads:
                cold.append(out.ttft_s)
                again = eng.generate(prompt, params, adapter=f"m{i}")[0]
                warm.append(again.ttft_s)
                answers[i].append(tuple(again.token_ids))
        order = order[::-1]  # (the second pass: the least recent first, mostly evicted)
    same = all(len(set(a)) == 1 for a in answers.values())
    distinct = len({a[0] for a in answers.values()})
    stats = eng.stats()["lora"]
    out = {"registered": len(paths), "slots": 8, "max_cpu_loras": args.max_cpu_loras,
           "pool_bytes": pool.memory_limit, "every_answer_its_adapters": same,
           "distinct_answers": distinct, "placements": stats["placements"],
           "evictions": stats["evictions"], "reads": stats["reads"],
           "host_bytes": stats["host_bytes"], "slot_bytes": stats["slot_bytes"],
           "ttft_cold_ms": statistics.median(cold) * 1e3 if cold else None,
           "ttft_warm_ms": statistics.median(warm) * 1e3 if warm else None}  # fmt: skip
    eng.close()
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="overhead,distinct,many")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--many", type=int, default=100)
    ap.add_argument("--max-cpu-loras", type=int, default=16)
    args = ap.parse_args()
    pre = load_pretrained("smollm2-135m")
    cfg = pre.model.config
    work = tempfile.mkdtemp(prefix="bench-lora-")
    path = os.path.join(os.path.dirname(__file__), "results", "bench_lora.json")
    result: dict = {"model": "smollm2-135m (Q4_1 packed; adapters float32)",
                    "cpus": os.cpu_count(), "rank": args.rank, "tokens": args.tokens,
                    "rounds": args.rounds}  # fmt: skip
    try:
        if "overhead" in args.parts:
            peft_paths = make_adapters(cfg, args.max_loras, args.rank, work)
            result["overhead"] = r = bench_overhead(pre, args, peft_paths)
            for k, v in r["decode_tok_s"].items():
                ratio = "" if k == "plain" else f"  ({r['vs_plain'][k]:.3f}x plain)"
                print(f"{k:13s} {v:7.1f} tok/s{ratio}")
            print(f"adapter load {r['load']['ms']:.1f} ms; compiles after warm-up "
                  f"{r['load']['compiles_after_warmup']}")  # fmt: skip
        many = numpy_adapters(cfg, max(args.many, 32), args.rank, work)
        if "distinct" in args.parts:
            result["distinct"] = r = bench_distinct(pre, args, many)
            for k, v in r["decode_tok_s"].items():
                ratio = "" if k == "base" else f"  ({r['vs_base'][k]:.3f}x the base)"
                print(f"batch 32, {k:11s} {v:7.1f} tok/s{ratio}")
        if "many" in args.parts:
            result["many"] = r = bench_many(pre, args, many[: args.many])
            print(f"{r['registered']} adapters on 8 slots, 1 GiB: every answer its "
                  f"adapter's: {r['every_answer_its_adapters']}, {r['distinct_answers']} "
                  f"distinct; TTFT cold {r['ttft_cold_ms']} ms, warm {r['ttft_warm_ms']} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
