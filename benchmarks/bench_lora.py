"""What LoRA adapters cost, side by side in one run, on SmolLM2-135M (its packed Q4_1
GGUF; the adapters stay float32).

Two engines of the same weights in one pool: one without adapter slots, one with
``--max-loras`` slots of rank up to ``--rank`` holding that many random PEFT adapters
(rank ``--rank`` on q, k, v, o, gate, up and down). Decode throughput of
``--concurrency`` requests of ``--tokens`` tokens each, interleaved rounds, medians:

* ``base_rows``: the engine with slots, every row on the base model, against the engine
  without (goal: nothing measurable, the base-only rows sort past the adapters' groups
  and are not multiplied);
* ``adapter_rows``: every row on an adapter (rows spread over the adapters);
* ``mixed_rows``: half the rows on adapters, half on the base.

``load``: an adapter's load time (reading its folder, checking it, writing its slot) and
the programs compiled by loading and unloading adapters after warm-up (goal: none).
Writes benchmarks/results/bench_lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    pre = load_pretrained("smollm2-135m")
    cfg = pre.model.config
    work = tempfile.mkdtemp(prefix="bench-lora-")
    paths = make_adapters(cfg, args.max_loras, args.rank, work)
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
    for eng, ads in cases.values():  # (warm: every program met once)
        decode_rate(eng, prompts, ads, 4)
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for key, (eng, ads) in cases.items():
            rates[key].append(decode_rate(eng, prompts, ads, args.tokens))
    med = {k: statistics.median(v) for k, v in rates.items()}
    # loading and unloading after warm-up compiles nothing
    lora.unload_adapter("a0")
    lora.load_adapter("a0", paths[-1])
    decode_rate(lora, prompts, names, 4)
    result = {
        "model": "smollm2-135m (Q4_1 packed; adapters float32)", "cpus": os.cpu_count(),
        "concurrency": n, "tokens": args.tokens, "rounds": args.rounds,
        "max_loras": args.max_loras, "rank": args.rank,
        "decode_tok_s": med,
        "vs_plain": {k: med[k] / med["plain"] for k in cases if k != "plain"},
        "load": {"ms": statistics.median(load_ms),
                 "adapter_bytes": lora.stats()["lora"]["adapters"][0]["bytes"],
                 "slot_bytes": lora.stats()["lora"]["slot_bytes"],
                 "compiles_after_warmup": lora.runner.compiles_after_warmup},
    }  # fmt: skip
    for k, v in med.items():
        ratio = "" if k == "plain" else f"  ({result['vs_plain'][k]:.3f}x plain)"
        print(f"{k:13s} {v:7.1f} tok/s{ratio}")
    print(f"adapter load {result['load']['ms']:.1f} ms; compiles after warm-up "
          f"{result['load']['compiles_after_warmup']}")  # fmt: skip
    path = os.path.join(os.path.dirname(__file__), "results", "bench_lora.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
    for eng in (plain, lora):
        eng.close()
    pool.close()


if __name__ == "__main__":
    main()
