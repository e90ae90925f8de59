"""Garbage-collector pauses while an engine serves, with and without ``serve``'s freeze of
the start-up heap (``jax_kvcached.serve.launch.freeze_start_up_heap``).

Each variant runs in its own process: SmolLM2-135M (fp32, host backend) warmed up, then
two 200-token streams beside a 1000-token prompt (``Engine.generate``), every collection
timed through ``gc.callbacks``. Prints a table per generation (count, longest, total) and
writes ``benchmarks/results/bench_gc.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_RUN = r"""
import gc, json, sys, time
import jax_kvcached as kv
from jax_kvcached import Engine, SamplingParams
from jax_kvcached.models import load_pretrained
from jax_kvcached.serve.launch import freeze_start_up_heap
eng = Engine(load_pretrained(sys.argv[1]).model, kv.Pool("1GiB", backend="host"), max_batch=4)
eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
frozen = freeze_start_up_heap() if sys.argv[2] == "freeze" else 0
tracked = len(gc.get_objects())
pauses, started = [], {}
def timed(phase, info):
    if phase == "start":
        started["t"] = time.perf_counter()
    else:
        pauses.append((info["generation"], (time.perf_counter() - started["t"]) * 1e3))
gc.callbacks.append(timed)
t0 = time.perf_counter()
eng.generate([[5, 6, 7], [8, 9, 10], list(range(100, 1100))],
             SamplingParams(max_tokens=200, ignore_eos=True))
run_s = time.perf_counter() - t0
gc.callbacks.remove(timed)
gens = {}
for g, ms in pauses:
    gens.setdefault(g, []).append(ms)
print(json.dumps({"frozen": frozen, "tracked": tracked, "run_s": run_s, "generations": {
    g: {"count": len(v), "max_ms": max(v), "total_ms": sum(v)} for g, v in sorted(gens.items())}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_gc.json"))
    args = ap.parse_args()
    result = {"model": args.model}
    for variant in ("as_is", "freeze"):
        p = subprocess.run([sys.executable, "-c", _RUN, args.model, variant],
                           capture_output=True, text=True, timeout=1800)  # fmt: skip
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        result[variant] = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"{'variant':8s} {'tracked':>8s} {'gen':>3s} {'count':>6s} {'longest ms':>11s} "
          f"{'total ms':>9s}")
    for variant in ("as_is", "freeze"):
        r = result[variant]
        for g, v in r["generations"].items():
            print(f"{variant:8s} {r['tracked']:8d} {g:>3s} {v['count']:6d} {v['max_ms']:11.1f} "
                  f"{v['total_ms']:9.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
