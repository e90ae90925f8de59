"""Soak: mixed traffic against one ``jax-kvcached serve`` with two models for a long time,
sampling the server's resident memory, mapped KV bytes, open files and threads.

Traffic (``--clients`` threads, seeded): streamed completions run to the end, streams the
client drops after a few tokens (disconnects), completions over four shared system
prompts (prefix-cache hits) and one thread that puts the second model to sleep and wakes
it again. Every ``--interval`` seconds a sample; the drift of each figure is reported
over the samples after ``--warmup`` seconds (last - first, max - min, and a least-squares
slope per minute), the goal being flat within noise. Resident memory is split into the
private part (``RssAnon``: where a leak shows) and the shared part (``RssShmem``: on the
host backend the KV pages, memfd memory resident once touched, so it grows toward the
mapped bytes as blocks are first written, bounded by mapped + reserved).

At the end traffic stops and the server is checked while idle, as the issue's accounting
asks: in every KV cache group of every model the blocks in use are exactly the cached
ones, and after a prefix-cache reset nothing is mapped; open files and threads are back
to their idle count after the warm-up.

``soak()`` is what ``tests/test_soak.py`` runs for two minutes. Writes
``benchmarks/results/bench_soak.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import numpy as np
from bench_serving import Process, serve_command

from jax_kvcached.serve.config import ServeConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ADMIN = {"Authorization": "Bearer soak"}


def kv_groups(url: str) -> list[dict[str, Any]]:
    """Every KV cache group of every served model, as ``/admin/memory`` reports it."""
    memory = httpx.get(url + "/admin/memory", headers=ADMIN, timeout=60).json()
    return [g for m in memory["models"].values() for g in m["kv_cache_groups"]]


class SoakServer(Process):
    def __init__(self, models: list[str], cache: str, extra: list[str]) -> None:
        super().__init__()
        config = ServeConfig(models=list(models), port=self.port, compile_cache=cache,
                             admin_key="soak", access_log=False)
        self.launch(serve_command(sys.executable, config, extra))

    def sample(self) -> dict[str, float]:
        pid = self.proc.pid
        with open(f"/proc/{pid}/status") as f:
            status = dict(ln.split(":", 1) for ln in f if ":" in ln)
        mapped = sum(g["mapped_bytes"] for g in kv_groups(self.url))
        mib = {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssShmem")}
        return {
            "rss_mib": mib["VmRSS"],
            # private memory (where a leak shows) and shared memory: on the host backend
            # the KV pages (memfd), resident once touched, so bounded by mapped + reserved
            "rss_anon_mib": mib["RssAnon"],
            "rss_shmem_mib": mib["RssShmem"],
            "mapped_mib": mapped / 2**20,
            "open_files": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"]),
        }


class Traffic:
    """The mixed clients; counts what each kind did and every unexpected answer."""

    def __init__(self, url: str, names: list[str], clients: int, seed: int,
                 sleep_every: float) -> None:  # fmt: skip
        self.url, self.names, self.sleep_every = url, names, sleep_every
        self.counts = {"streams": 0, "disconnects": 0, "prefix_requests": 0, "sleeps": 0,
                       "wakes": 0, "woken_by_requests": 0}  # fmt: skip
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.systems = [f"System prompt {i}: " + "you are a careful assistant. " * 12
                        for i in range(4)]  # fmt: skip
        self.threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True)
                        for i in range(clients)]  # fmt: skip
        if sleep_every > 0 and len(names) > 1:
            self.threads.append(threading.Thread(target=self._sleeper, daemon=True))
        for t in self.threads:
            t.start()

    def _bad(self, what: str) -> None:
        self.errors.append(what[:300])

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=300) as c:
            while not self.stop.is_set():
                name = rng.choice(self.names)
                kind = rng.choices(["stream", "disconnect", "prefix"], [2, 1, 2])[0]
                try:
                    if kind == "prefix":
                        body = {"model": name, "prompt": rng.choice(self.systems)
                                + f"question {rng.randrange(10**6)}?", "max_tokens": 8,
                                "temperature": 0}  # fmt: skip
                        r = c.post("/v1/completions", json=body)
                        if r.status_code != 200:
                            self._bad(f"prefix: {r.status_code} {r.text}")
                        self.counts["prefix_requests"] += 1
                        continue
                    body = {"model": name, "prompt": f"story {rng.randrange(10**6)}:",
                            "max_tokens": rng.randint(16, 64), "stream": True,
                            "ignore_eos": True, "temperature": 0.8, "seed": seed}  # fmt: skip
                    cut = rng.randint(1, 8) if kind == "disconnect" else None
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            self._bad(f"{kind}: {r.status_code} {r.read()!r}")
                            continue
                        got = 0
                        for line in r.iter_lines():
                            if '"error"' in line:
                                self._bad(f"{kind}: {line}")
                            got += line.startswith("data: {")
                            if cut is not None and got >= cut:
                                break  # leaving the block closes the connection
                    self.counts["disconnects" if cut else "streams"] += 1
                except httpx.HTTPError as e:
                    self._bad(f"{kind}: {type(e).__name__}: {e}")

    def _sleeper(self) -> None:
        name = self.names[-1]
        while not self.stop.wait(self.sleep_every):
            for action in ("sleep", "wake"):
                r = httpx.post(f"{self.url}/admin/{action}", json={"model": name},
                               headers=ADMIN, timeout=300)  # fmt: skip
                if r.status_code == 200:
                    self.counts[action + "s"] += 1
                elif r.status_code == 409 and action == "wake":  # a request woke it first
                    self.counts["woken_by_requests"] += 1
                elif r.status_code != 409:  # (a sleep racing a wake: 409, fine)
                    self._bad(f"{action}: {r.status_code} {r.text}")
                time.sleep(1.0)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


def drift(samples: list[dict], key: str) -> dict[str, float]:
    xs = np.array([s["t_min"] for s in samples])
    ys = np.array([s[key] for s in samples])
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(samples) > 2 else float("nan")
    return {"first": float(ys[0]), "last": float(ys[-1]), "change": float(ys[-1] - ys[0]),
            "range": float(ys.max() - ys.min()), "slope_per_min": slope}  # fmt: skip


def idle(srv: SoakServer, settle: float = 12.0) -> dict[str, float]:
    """A sample once nothing runs (anyio's idle worker threads end after 10 s)."""
    time.sleep(settle)
    return srv.sample()


def accounting(srv: SoakServer) -> dict[str, Any]:
    """Idle: blocks in use are exactly the cached ones in every KV cache group; after a
    prefix-cache reset nothing is mapped."""
    groups = kv_groups(srv.url)
    only_cached = all(g["used_blocks"] == g["cached_blocks"] for g in groups)
    httpx.post(srv.url + "/reset_prefix_cache", headers=ADMIN, timeout=60).raise_for_status()
    left = sum(g["mapped_bytes"] for g in kv_groups(srv.url))
    return {"only_cached_blocks_in_use": only_cached, "mapped_bytes_after_reset": left}


def soak(models: list[str], minutes: float, interval: float, warmup: float, clients: int,
         sleep_every: float, extra: list[str], seed: int = 0,
         cache: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Runs the soak; returns its samples, drifts, counts, errors and the idle checks."""
    cache = cache or tempfile.mkdtemp(prefix="kvcached-soak-cache-")
    srv = SoakServer(models, cache, extra)
    names = [m.split("=")[0] for m in models]
    try:
        srv.ready()
        t0, samples, counts, errors = time.monotonic(), [], {}, []

        def run(until_s: float) -> None:
            traffic = Traffic(srv.url, names, clients, seed + len(samples), sleep_every)
            while (now := time.monotonic() - t0) < until_s:
                time.sleep(min(interval, max(0.0, until_s - now)))
                samples.append({"t_min": round((time.monotonic() - t0) / 60, 2),
                                **srv.sample()})  # fmt: skip
                print(json.dumps(samples[-1]), flush=True)
            traffic.finish()
            for k, v in traffic.counts.items():
                counts[k] = counts.get(k, 0) + v
            errors.extend(traffic.errors)

        run(warmup)
        warm_idle = idle(srv)  # open files and threads once nothing runs, after warm-up
        t_resume = time.monotonic()
        run(minutes * 60 + (t_resume - t0 - warmup))  # (the idle pause does not count)
        end_idle = idle(srv)
        checks = accounting(srv)
    finally:
        srv.stop()
    after = [s for s in samples if s["t_min"] * 60 >= warmup] or samples[-1:]
    return {
        "models": models, "minutes": minutes, "interval_s": interval, "warmup_s": warmup,
        "clients": clients, "samples": samples, "counts": counts, "errors": errors,
        "drift": {k: drift(after, k) for k in ("rss_mib", "rss_anon_mib", "rss_shmem_mib",
                                               "mapped_mib", "open_files", "threads")},
        "idle_after_warmup": warm_idle, "idle_end": end_idle, **checks,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=None,
                    help="NAME=MODEL, twice (default a=smollm2-135m, b=tiny-llama)")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--interval", type=float, default=60, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=300, help="seconds before drift counts")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sleep-every", type=float, default=45,
                    help="seconds between sleep / wake cycles of the second model")
    ap.add_argument("--server-args", default="--memory 512MiB --host-cache-tokens 4096")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_soak.json"))
    args = ap.parse_args()
    models = args.model or ["a=smollm2-135m", "b=tiny-llama"]
    r = soak(models, args.minutes, args.interval, args.warmup, args.clients,
             args.sleep_every, args.server_args.split())  # fmt: skip
    print(f"\n{'figure':12s} {'first':>9s} {'last':>9s} {'change':>9s} {'range':>9s} "
          f"{'per min':>9s}   (after {args.warmup:.0f} s of warm-up)")
    for k, d in r["drift"].items():
        print(f"{k:12s} {d['first']:9.1f} {d['last']:9.1f} {d['change']:9.1f} "
              f"{d['range']:9.1f} {d['slope_per_min']:9.3f}")
    print(f"traffic: {r['counts']}; unexpected answers: {len(r['errors'])}")
    w, e = r["idle_after_warmup"], r["idle_end"]
    print(f"idle after warm-up / at the end: open files {w['open_files']} / {e['open_files']}, "
          f"threads {w['threads']} / {e['threads']}, RSS {w['rss_mib']:.0f} / "
          f"{e['rss_mib']:.0f} MiB")
    print(f"idle at the end: only cached blocks in use: {r['only_cached_blocks_in_use']}; "
          f"mapped after a prefix-cache reset: {r['mapped_bytes_after_reset']} bytes")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(r, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
