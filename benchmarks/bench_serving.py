"""Serving benchmark in the manner of vLLM's ``benchmark_serving``: a real ``jax-kvcached
serve`` process, requests streamed through the OpenAI completions route with httpx.

Parts (each selectable with ``--parts``):
- ``startup``: launch to the first answer with an empty compilation cache, then again with
  the cache it left (warm start), and the server's own compile figures from its log.
- ``stall``: five runs, each a fresh server (warm start): streams of short completions
  run while new long prompts (``--stall-prompts``: 1k-6k tokens, a different one each
  run) arrive, the first after start and a later one; per prompt the streams' longest
  inter-token gap while it prefills over their median gap before, and its TTFT.
- ``rates``: Poisson arrivals at each of ``--rates`` requests/s, prompt and output lengths
  drawn from a ShareGPT-like distribution (lognormal, synthesized and seeded): TTFT, TPOT,
  ITL p50 / p99 and output tokens/s per rate.

Prints a table per part and writes JSON (and a plot of the rates with matplotlib).
``--python`` runs the server with another interpreter (a build of another commit: the
"before" of a side-by-side run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from jax_kvcached.serve.config import ServeConfig

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

    def ready(self, timeout: float = 900) -> Process:
        """Waits until ``GET /health`` says ``ok`` (every model loaded and compiled)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).json().get("status") == "ok":
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"not ready: {self.tail()}")

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

    def __init__(self, python: str, model: str, extra: list[str], cache_dir: str,
                 config: ServeConfig | None = None) -> None:  # fmt: skip
        super().__init__()
        config = dataclasses.replace(config or ServeConfig(), models=[model], port=self.port,
                                     compile_cache=cache_dir, access_log=False)  # fmt: skip
        self.launch(serve_command(python, config, extra))


def serve_command(python: str, config: ServeConfig, extra: Sequence[str] = ()) -> list[str]:
    """``jax-kvcached serve`` with ``config``'s flags (built from the config dataclasses,
    so checked as the server checks them), then ``extra``: flags a user passed through."""
    return [python, "-m", "jax_kvcached.cli", "serve", *config.flags(), *extra]


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


def part_startup(args, cache: str) -> dict:
    """Launch to the first answer with the empty compilation cache ``cache``, then with
    what that start left in it."""
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


class Streams:
    """``count`` threads that each stream short greedy completions back to back until
    :meth:`stop`; every request's inter-token gaps are kept with their arrival times."""

    def __init__(self, url: str, count: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.gaps: list[tuple[float, float]] = []  # (arrival time, gap in seconds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(count)]  # fmt: skip
        for i, th in enumerate(self._threads):
            th.start()
            time.sleep(0.2 * (i + 1))  # staggered: their prompts arrive apart

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            out: dict = {}
            try:
                stream(self.url, [5 + i, 6, 7], self.max_tokens, out)
            except httpx.HTTPError as e:
                self.errors.append(repr(e))
                return
            t = out["times"]
            self.gaps += [(b, b - a) for a, b in zip(t, t[1:], strict=False)]

    def between(self, t0: float, t1: float) -> list[float]:
        return [g for t, g in self.gaps if t0 <= t <= t1]

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join()


def long_prompt(url: str, prompt: list[int]) -> tuple[float, float]:
    """Sends a prompt (one output token); its (send, done) times."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": 1}, timeout=3600)  # fmt: skip
    r.raise_for_status()
    return t0, time.perf_counter()


def part_stall(args, cache: str) -> dict:
    """Each run: a fresh server (warm compilation cache), ``--stall-streams`` streams of
    short completions back to back, then new (uncached) long prompts one after another:
    the first after start, then the later ones. Per prompt: the streams' longest gap
    while it prefills over their median gap before it arrived, and its TTFT."""
    rng = np.random.default_rng(args.seed)
    runs = []
    for run, n in enumerate(args.stall_prompts):
        srv = Server(args.python, args.model, args.server_args, cache)
        try:
            srv.first_answer()
            streams = Streams(srv.url, args.stall_streams, args.stall_tokens)
            time.sleep(args.stall_baseline)
            base_end = time.perf_counter()
            sent = []
            for k in range(args.stall_later + 1):
                length = n if k == 0 else args.stall_prompts[(run + k) % len(args.stall_prompts)]
                sent.append((length, *long_prompt(srv.url, rng.integers(
                    3, args.max_id, length).tolist())))  # fmt: skip
                time.sleep(0.5)
            streams.stop()  # (a completion's gaps are kept when it ends)
            if streams.errors:
                raise RuntimeError(f"a stream failed: {streams.errors[0]}")
            med = statistics.median(streams.between(0, base_end))
            prompts = []
            for k, (length, t0, t1) in enumerate(sent):
                during = streams.between(t0, t1)
                prompts.append({
                    "tokens": length, "first_after_start": k == 0, "ttft_s": t1 - t0,
                    "prefill_tokens_per_s": length / (t1 - t0), "stream_gaps": len(during),
                    "longest_gap_ms": max(during) * 1e3, "ratio": max(during) / med,
                    "median_gap_during_ms": statistics.median(during) * 1e3,
                    "top_gaps_ms": sorted((round(g * 1e3, 1) for g in during), reverse=True)[:5],
                })  # fmt: skip
        finally:
            srv.stop()
        runs.append({"run": run + 1, "median_gap_ms": med * 1e3, "prompts": prompts})
        for p in prompts:
            print(f"stall, run {run + 1}, {'first' if p['first_after_start'] else 'later'} "
                  f"{p['tokens']}-token prompt: longest gap {p['longest_gap_ms']:.1f} ms over a "
                  f"median {med * 1e3:.1f} ms ({p['ratio']:.2f}x; median during "
                  f"{p['median_gap_during_ms']:.1f} ms over {p['stream_gaps']} gaps); TTFT "
                  f"{p['ttft_s']:.1f} s ({p['prefill_tokens_per_s']:.0f} tokens/s)")  # fmt: skip
    ratios = [p["ratio"] for r in runs for p in r["prompts"]]
    print(f"stall: worst {max(ratios):.2f}x over {len(ratios)} prompts "
          f"(goal <= 3x for every one)")  # fmt: skip
    return {"streams": args.stall_streams, "stream_tokens": args.stall_tokens,
            "runs": runs, "worst_ratio": max(ratios)}  # fmt: skip


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
    ap.add_argument("--stall-prompts", default="1024,2048,3072,4096,6000",
                    help="the first long prompt of each run (one run, one fresh server each)")
    ap.add_argument("--stall-later", type=int, default=1,
                    help="new long prompts after the first in each run")
    ap.add_argument("--stall-streams", type=int, default=2, help="streams while they prefill")
    ap.add_argument("--stall-tokens", type=int, default=128, help="each streamed completion's")
    ap.add_argument("--stall-baseline", type=float, default=4.0,
                    help="seconds of streaming before the first long prompt")  # fmt: skip
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
    cache = tempfile.mkdtemp(prefix="kvcached-bench-cache-")
    if "startup" in parts:
        result["startup"] = part_startup(args, cache)
    if "stall" in parts:
        if "startup" not in parts:  # fill the compilation cache: the runs start warm
            srv = Server(args.python, args.model, args.server_args, cache)
            srv.first_answer()
            srv.stop()
        result["stall"] = part_stall(args, cache)
    if "rates" in parts:
        srv = Server(args.python, args.model, args.server_args, cache)
        try:
            srv.first_answer()
            result["rates"] = part_rates(args, srv.url)
        finally:
            srv.stop()
        if args.plot:
            runs = [(args.label, result["rates"])]
            if args.compare:
                with open(args.compare) as f:
                    other = json.load(f)
                runs.append((other.get("label", "other"), other["rates"]))
            plot(runs, args.plot)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
