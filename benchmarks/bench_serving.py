"""Serving benchmark in the manner of vLLM's ``benchmark_serving``: a real ``jax-kvcached
serve`` process, requests streamed through the OpenAI completions route with httpx.

Parts (each selectable with ``--parts``):
- ``startup``: launch to the first answer with an empty compilation cache, then again with
  the cache it left (warm start), and the server's own compile figures from its log.
- ``stall``: one stream decodes while a long prompt (``--stall-prompts`` tokens) arrives:
  the stream's median inter-token gap before, its longest gap while the prompt is
  prefilled, and the prompt's prefill rate (its TTFT) alone.
- ``rates``: Poisson arrivals at each of ``--rates`` requests/s, prompt and output lengths
  drawn from a ShareGPT-like distribution (lognormal, synthesized and seeded): TTFT, TPOT,
  ITL p50 / p99 and output tokens/s per rate.

Prints a table per part and writes JSON (and a plot of the rates with matplotlib).
``--python`` runs the server with another interpreter (a build of another commit: the
"before" of a side-by-side run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A subprocess on a free loopback port (``self.url``) with its output in a log
    file, launched by :meth:`launch`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)

    def launch(self, cmd: list[str]) -> None:
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
        )  # the interpreter's package

    def first_answer(self, timeout: float = 900, prompt: Any = None) -> float:
        """Seconds from launch to the first completed answer of model ``m`` to
        ``prompt`` (default: token ids 1, 2, 3)."""
        body = {"model": "m", "prompt": [1, 2, 3] if prompt is None else prompt,
                "max_tokens": 1}  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[0]} exited: {self.tail()}")
            try:
                r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
                if r.status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"no answer: {self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Server(Process):
    """A ``jax-kvcached serve`` subprocess on a free loopback port."""

    def __init__(self, python: str, model: str, extra: list[str], cache_dir: str) -> None:
        super().__init__()
        self.launch([python, "-m", "jax_kvcached.cli", "serve", "--model", model, "--port",
                     str(self.port), "--compile-cache", cache_dir, "--no-access-log",
                     *extra])  # fmt: skip


def stream(url: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    """One streamed completion; fills ``out`` with send time, token arrival times."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    out["sent"] = time.perf_counter()
    out["times"] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                out["times"].append(time.perf_counter())
    out["done"] = time.perf_counter()


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def part_startup(args) -> dict:
    cache = tempfile.mkdtemp(prefix="kvcached-bench-cache-")
    res = {}
    for label in ("cold", "warm"):
        srv = Server(args.python, args.model, args.server_args, cache)
        try:
            res[f"{label}_s"] = srv.first_answer()
            lines = srv.tail().splitlines()
            res[f"{label}_log"] = [ln for ln in lines if "programs ready" in ln][-1:]
        finally:
            srv.stop()
    print(f"startup: cold {res['cold_s']:.1f} s, warm {res['warm_s']:.1f} s to the first answer")
    return res


def part_stall(args, url: str) -> dict:
    rng = np.random.default_rng(args.seed)
    res = {}
    for n in args.stall_prompts:
        # The prompt alone: its prefill rate.
        long = rng.integers(3, args.max_id, n).tolist()
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={
            "model": "m", "prompt": long, "max_tokens": 1}, timeout=1800)  # fmt: skip
        r.raise_for_status()
        alone = time.perf_counter() - t0
        # A stream decoding; the long prompt (a new one: no prefix hit) arrives mid-stream.
        long = rng.integers(3, args.max_id, n).tolist()
        out: dict = {}
        th = threading.Thread(target=stream, args=(url, [5, 6, 7], args.stall_tokens, out))
        th.start()
        while len(out.get("times", [])) < 30:
            time.sleep(0.01)
        t_send = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={
            "model": "m", "prompt": long, "max_tokens": 1}, timeout=1800)  # fmt: skip
        t_done = time.perf_counter()
        th.join()
        times = out["times"]
        gaps = np.diff(times)
        before = [g for g, t in zip(gaps, times[1:], strict=True) if t < t_send]
        during = [g for g, t in zip(gaps, times[1:], strict=True) if t_send <= t <= t_done + 0.5]
        med = statistics.median(before)
        res[n] = {
            "prefill_alone_s": alone, "prefill_tokens_per_s": n / alone,
            "median_gap_ms": med * 1e3, "longest_gap_ms": max(during) * 1e3,
            "ratio": max(during) / med, "tokens_during": len(during),
            "median_gap_during_ms": statistics.median(during) * 1e3,
            "top_gaps_during_ms": sorted((g * 1e3 for g in during), reverse=True)[:5],
            "gaps_during_ms": [round(g * 1e3, 1) for g in during],
        }  # fmt: skip
        print(f"stall, {n}-token prompt: stream median gap {med * 1e3:.1f} ms, longest gap "
              f"while it prefills {max(during) * 1e3:.1f} ms ({max(during) / med:.1f}x; median "
              f"{statistics.median(during) * 1e3:.1f} ms over {len(during)} tokens); the "
              f"prompt alone prefills at {n / alone:.0f} tokens/s")  # fmt: skip
    if len(args.stall_prompts) >= 2:
        a, b = args.stall_prompts[0], args.stall_prompts[-1]
        ratio = res[b]["prefill_tokens_per_s"] / res[a]["prefill_tokens_per_s"]
        res["prefill_rate_ratio"] = ratio
        print(f"prefill rate {b} vs {a} tokens: {ratio:.2f}x")
    return res


def sharegpt_like(rng, n: int, max_id: int, max_len: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: lognormal lengths around ShareGPT's shape
    (prompts median ~120 tokens with a long tail, outputs median ~60), clipped."""
    ins = np.clip(rng.lognormal(np.log(120), 0.9, n), 4, max_len).astype(int)
    outs = np.clip(rng.lognormal(np.log(60), 0.7, n), 4, 256).astype(int)
    return [(rng.integers(3, max_id, i).tolist(), int(o)) for i, o in zip(ins, outs, strict=True)]


def part_rates(args, url: str) -> dict:
    res = {}
    for rate in args.rates:
        rng = np.random.default_rng(args.seed + int(rate * 1000))
        work = sharegpt_like(rng, args.num_prompts, args.max_id, args.max_prompt_len)
        outs = [dict() for _ in work]
        threads = []
        t0 = time.perf_counter()
        for (prompt, n), out in zip(work, outs, strict=True):
            th = threading.Thread(target=stream, args=(url, prompt, n, out))
            th.start()
            threads.append(th)
            time.sleep(rng.exponential(1 / rate))
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        ttft = [o["times"][0] - o["sent"] for o in outs if o["times"]]
        tpot = [(o["times"][-1] - o["times"][0]) / (len(o["times"]) - 1)
                for o in outs if len(o["times"]) > 1]  # fmt: skip
        itl = [g for o in outs for g in np.diff(o["times"])]
        tokens = sum(len(o["times"]) for o in outs)
        row = {
            "rate": rate, "requests": len(work), "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall, "wall_s": wall,
            "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "tpot_p50_ms": pct(tpot, 50) * 1e3, "tpot_p99_ms": pct(tpot, 99) * 1e3,
            "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
        }  # fmt: skip
        res[str(rate)] = row
        print(f"rate {rate:>5} req/s: {tokens / wall:6.1f} out tok/s | TTFT p50 "
              f"{row['ttft_p50_ms']:7.0f} p99 {row['ttft_p99_ms']:7.0f} ms | TPOT p50 "
              f"{row['tpot_p50_ms']:5.0f} p99 {row['tpot_p99_ms']:5.0f} ms | ITL p50 "
              f"{row['itl_p50_ms']:5.0f} p99 {row['itl_p99_ms']:6.0f} ms")  # fmt: skip
    return res


def plot(runs: list[tuple[str, dict]], path: str) -> None:
    """TTFT, ITL and TPOT p50 / p99 against the request rate, one line style per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for (label, rates), style in zip(runs, ("o-", "s--", "^:"), strict=False):
        xs = [r["rate"] for r in rates.values()]
        for key, a in zip(("ttft", "itl", "tpot"), ax, strict=True):
            for q in ("p50", "p99"):
                a.plot(xs, [r[f"{key}_{q}_ms"] for r in rates.values()], style,
                       label=f"{label} {q}".strip())  # fmt: skip
            a.set_xlabel("requests/s")
            a.set_ylabel(f"{key.upper()} (ms)")
            a.set_yscale("log")
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="m=smollm2-135m")
    ap.add_argument("--python", default=sys.executable, help="the server's interpreter")
    ap.add_argument("--server-args", default="", help="more serve flags, one string")
    ap.add_argument("--parts", default="startup,stall,rates")
    ap.add_argument("--rates", default="0.1,0.2,0.4", help="requests/s, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    ap.add_argument("--stall-prompts", default="1290,6000", help="long prompt lengths")
    ap.add_argument("--stall-tokens", type=int, default=400, help="the stream's length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-id", type=int, default=40000, help="prompt token ids below this")
    ap.add_argument("--max-prompt-len", type=int, default=1500, help="the longest prompt")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_serving.json"))
    ap.add_argument("--plot", default=None, help="a PNG of the rates (default: none)")
    ap.add_argument(
        "--compare",
        default=None,
        metavar="JSON",
        help="another run's JSON (e.g. an older commit's) drawn beside this one",
    )
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only draw --plot from this run's JSON (and --compare)")  # fmt: skip
    args = ap.parse_args()
    args.rates = [float(x) for x in args.rates.split(",")]
    args.stall_prompts = [int(x) for x in args.stall_prompts.split(",")]
    args.server_args = args.server_args.split()
    parts = args.parts.split(",")
    if args.replot:
        with open(args.replot) as f:
            mine = json.load(f)
        runs = [(mine.get("label", ""), mine["rates"])]
        if args.compare:
            with open(args.compare) as f:
                other = json.load(f)
            runs.append((other.get("label", "other"), other["rates"]))
        plot(runs, args.plot or "bench_serving.png")
        return
    result: dict = {"model": args.model, "label": args.label, "python": args.python}
    if "startup" in parts:
        result["startup"] = part_startup(args)
    if "stall" in parts or "rates" in parts:
        cache = tempfile.mkdtemp(prefix="kvcached-bench-cache-")
        srv = Server(args.python, args.model, args.server_args, cache)
        try:
            srv.first_answer()
            if "stall" in parts:
                result["stall"] = part_stall(args, srv.url)
            if "rates" in parts:
                result["rates"] = part_rates(args, srv.url)
                if args.plot:
                    runs = [(args.label, result["rates"])]
                    if args.compare:
                        with open(args.compare) as f:
                            other = json.load(f)
                        runs.append((other.get("label", "other"), other["rates"]))
                    plot(runs, args.plot)
        finally:
            srv.stop()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
