"""Replicas behind a router: a shared-prefix workload over two ``jax-kvcached serve``
replicas behind a real router on loopback, one routing policy after another.

Workload: ``--systems`` system prompts of about ``--system-tokens`` tokens, ``--requests``
users each asking a short question after one of them (shuffled), ``--concurrency``
streams, ``--max-tokens`` tokens per answer, over ``/v1/completions`` (text prompts, as
HTTP routers see them). Each replica's prefix cache holds ``--cached-tokens`` idle tokens:
about half the system prompts, so where a prompt is sent decides whether it hits.

Policies (each a router process started fresh, the replicas' caches reset between):
- ``smg round_robin``: the Shepherd Model Gateway spreading requests in turn;
- ``smg cache_aware``: its prefix-tree routing (an approximate tree of the texts it
  sent to each worker: what an HTTP worker gets);
- ``vllm-router kv_aware``: vLLM's router fed by our KV-cache events (``--kv-events``:
  vLLM's ZMQ stream, block hashes of the token ids it rehashes, ``/tokenize`` for the
  request's tokens).

Reported per policy: the prefix-cache hit rate over both replicas (prompt tokens found
cached / looked up, from their ``/metrics``), TTFT p50 / p99 and wall time. Writes
benchmarks/results/bench_router.json. Needs ``smg`` and ``vllm-router`` (the test extra).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Process, Server, free_port  # noqa: E402

from jax_kvcached.engine.config import EngineConfig  # noqa: E402
from jax_kvcached.serve.config import ServeConfig  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_router.json")
ADMIN = "bench-admin"
WORDS = ("river stone light market garden winter letter engine window forest silver "
         "harbor signal mountain paper orchard lantern bridge canvas meadow thunder copper "
         "valley compass anchor violet marble ember falcon glacier").split()  # fmt: skip


def workload(systems: int, system_tokens: int, requests: int, seed: int) -> list[str]:
    """Text prompts: a system prompt (of ``systems``) and a user's own question."""
    rng = np.random.default_rng(seed)
    words = system_tokens * 3 // 4  # about 4/3 tokens a word with this vocabulary
    heads = [f"System {i}: you are assistant {i}. " + " ".join(rng.choice(WORDS, words))
             for i in range(systems)]  # fmt: skip
    out = [heads[i % systems] + f"\nUser {i}: " + " ".join(rng.choice(WORDS, 8)) + "?\nAnswer:"
           for i in range(requests)]  # fmt: skip
    rng.shuffle(out)
    return out


def port_pair() -> int:
    """A free port whose next one is free too (events and their replay beside them)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


class Router(Process):
    """A router process on a free loopback port in front of ``workers``; ready at its
    :meth:`first_answer`."""

    def __init__(self, cmd: list[str]) -> None:
        super().__init__()
        self.launch([*cmd, "--host", "127.0.0.1", "--port", str(self.port)])


def smg(policy: str, workers: list[Server], metrics_port: int | None = None) -> Router:
    exe = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
    return Router([exe, "launch", "--policy", policy, "--log-level", "warn",
                   "--prometheus-port", str(metrics_port or free_port()),
                   "--load-monitor-interval", "1",
                   "--worker-urls", *[w.url for w in workers]])  # fmt: skip


def vllm_router(workers: list[Server], events: list[int], metrics_port: int | None = None
                ) -> Router:  # fmt: skip
    exe = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                      "vllm-router")  # fmt: skip
    cmd = [exe, "--policy", "kv_aware", "--kv-event-model", "m", "--kv-event-block-size", "16",
           "--prometheus-port", str(metrics_port or free_port()),
           "--worker-urls", *[w.url for w in workers]]  # fmt: skip
    for w, port in zip(workers, events, strict=True):
        cmd += ["--kv-event-source", f"{w.url}=tcp://127.0.0.1:{port}",
                "--kv-event-replay-source", f"{w.url}=tcp://127.0.0.1:{port + 1}"]
    return Router(cmd)


def counters(workers: list[Server]) -> tuple[float, float]:
    """(prefix hit tokens, looked-up tokens) summed over the replicas."""
    hits = queries = 0.0
    for w in workers:
        text = httpx.get(w.url + "/metrics", timeout=30).text
        hits += float(re.search(r'^kvcached_prefix_hit_tokens_total\{model="m"\} (\S+)', text,
                                re.M).group(1))  # fmt: skip
        queries += float(re.search(r'^kvcached_prefix_query_tokens_total\{model="m"\} (\S+)',
                                   text, re.M).group(1))  # fmt: skip
    return hits, queries


def one(url: str, prompt: str, max_tokens: int, out: list) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter() - t0)
                return


def run(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[float]:
    ttft: list[float] = []
    queue = list(prompts)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                p = queue.pop()
            try:
                one(url, p, max_tokens, ttft)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=768)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--cached-tokens", type=int, default=3584)
    ap.add_argument("--policies", default="smg:round_robin,smg:cache_aware,vllm-router:kv_aware")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()

    cache_dir = tempfile.mkdtemp(prefix="bench-router-cc-")
    events = [port_pair(), port_pair()]
    workers = [
        Server(sys.executable, f"m={args.model}", [], cache_dir, ServeConfig(
            admin_key=ADMIN, engine=EngineConfig(
                max_cached_tokens=args.cached_tokens, kv_events=f"tcp://*:{port}",
                kv_events_replay=f"tcp://*:{port + 1}")))  # fmt: skip
        for port in events
    ]
    prompts = workload(args.systems, args.system_tokens, args.requests, seed=0)
    rows = []
    try:
        for w in workers:
            w.first_answer()
        for spec in args.policies.split(","):
            router_name, policy = spec.split(":")
            for w in workers:
                httpx.post(w.url + "/reset_prefix_cache", timeout=60,
                           headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()
            router = (vllm_router(workers, events) if router_name == "vllm-router"
                      else smg(policy, workers))  # fmt: skip
            try:
                router.first_answer(timeout=120, prompt="hi")
                for w in workers:  # (the readiness probe's own prompt)
                    httpx.post(w.url + "/reset_prefix_cache", timeout=60,
                               headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
                h0, q0 = counters(workers)
                t0 = time.perf_counter()
                ttft = run(router.url, prompts, args.concurrency, args.max_tokens)
                wall = time.perf_counter() - t0
                h1, q1 = counters(workers)
            finally:
                router.stop()
            ttft.sort()
            rows.append({
                "router": router_name, "policy": policy,
                "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
                "ttft_p50_s": statistics.median(ttft),
                "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                "wall_s": wall, "requests": len(ttft),
            })  # fmt: skip
            r = rows[-1]
            print(f"{router_name:12s} {policy:12s} hit rate {r['hit_rate']:.3f}  TTFT p50 "
                  f"{r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s  {wall:.1f}s", flush=True)
    finally:
        for w in workers:
            w.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"\n{'router':12s} {'policy':12s} {'hit rate':>8s} {'TTFT p50':>9s} {'p99':>8s}")
    for r in rows:
        print(f"{r['router']:12s} {r['policy']:12s} {r['hit_rate']:8.3f} "
              f"{r['ttft_p50_s']:8.3f}s {r['ttft_p99_s']:7.3f}s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "replicas": 2, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
