"""Multi-tenant benchmark: three models with alternating bursts, one elastic shared pool
vs. static equal partitions of the same total budget.

Each model's request rate ramps up and down in its own window (like kvcached's
bench_latency_benefit), so at any time one model is busy and the others are nearly idle.
Both configurations serve the same seeded arrival trace through the same ServingLoop,
after compiling the step shapes the trace can hit. Prints a table of TTFT p50/p99,
throughput, peak mapped memory and preemptions with static/elastic ratios, writes JSON
and a PNG timeline of per-model memory to benchmarks/results/.

The process section (``--processes``): the same bursts served by three ``jax-kvcached
serve`` processes (one model each) over HTTP: sharing one budget through a process group
(``--group``) vs. static per-process partitions of the same total.

The host-tier section (``--host-tier``, also part of the default run): two tenants with
cached prefixes take turns bursting; each burst reclaims the idle tenant's idle cached
prefixes. The idle tenant's next requests (same prefixes) then find them on the device,
in the host tier, or nowhere: its prefix hits after the other's burst, as a share of its
hits with no burst, and its TTFT, with and without the tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time

import numpy as np

import jax_kvcached as kv
from jax_kvcached.engine.config import EngineConfig
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.serve.config import ServeConfig
from jax_kvcached.serve.loop import ServingLoop

MiB = 1 << 20
MODELS = {
    "llama-4l": BUILTIN_CONFIGS["tiny-llama"],
    "qwen-3l": dataclasses.replace(BUILTIN_CONFIGS["tiny-qwen2"], num_kv_heads=2),
    "llama-2l": dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], num_layers=2, num_kv_heads=4),
}


@dataclasses.dataclass(frozen=True)
class Arrival:
    t: float
    model: str
    prompt: list[int]


def rate(t: float, i: int, n: int, duration: float, hi: float, lo: float) -> float:
    """Model i's request rate: a triangle over its window of the run, lo elsewhere."""
    w = duration / n
    x = (t - i * w) / w
    return lo + (hi - lo) * max(0.0, 1.0 - abs(2 * x - 1)) if 0 <= x <= 1 else lo


def make_trace(duration, hi, lo, prompt_len, seed, names=tuple(MODELS)) -> list[Arrival]:
    """Non-homogeneous Poisson arrivals (by thinning), seeded."""
    rng = np.random.default_rng(seed)
    out = []
    for i, name in enumerate(names):
        t = 0.0
        while True:
            t += rng.exponential(1.0 / hi)
            if t >= duration:
                break
            if rng.random() < rate(t, i, len(names), duration, hi, lo) / hi:
                n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
                out.append(Arrival(t, name, rng.integers(1, 250, size=n).tolist()))
    return sorted(out, key=lambda a: a.t)


def build(config: str, budget: int, page: int, max_batch: int, models) -> tuple[dict, list]:
    """Engines for 'elastic' (one pool) or 'static' (one pool of budget/3 per model)."""
    pools = []
    if config == "elastic":
        pools = [kv.Pool(budget, page_size=page, backend="host")]
    else:
        share = budget // len(MODELS) // page * page
        pools = [kv.Pool(share, page_size=page, backend="host") for _ in MODELS]
    engines = {}
    for i, name in enumerate(MODELS):
        pool = pools[0] if config == "elastic" else pools[i]
        engines[name] = Engine(
            models[name], pool, name=name, max_batch=max_batch, max_num_batched_tokens=128,
            prefix_caching=False,
        )  # fmt: skip
    return engines, pools


def run_trace(engines, trace, max_tokens, sample_every=0.05) -> dict:
    """Serves the trace in real time; returns per-request times and a memory timeline."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    recs = [{"model": a.model, "t": a.t, "first": None, "end": None, "n": 0} for a in trace]
    timeline = []
    done = threading.Event()
    left = [len(trace)]
    lock = threading.Lock()
    compiled0 = {n: e.num_compiled for n, e in engines.items()}
    preempt0 = {n: e.num_preemptions for n, e in engines.items()}

    with ServingLoop(engines, max_queue=10_000) as loop:
        t0 = time.perf_counter()

        def event(rec):
            def on(kind, value):
                now = time.perf_counter() - t0
                if kind == "token":
                    rec["n"] += 1
                    if rec["first"] is None:
                        rec["first"] = now
                    return
                rec["end"] = now
                if kind == "error":
                    rec["error"] = repr(value)
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            return on

        def monitor():
            while not done.is_set():
                row = {"t": time.perf_counter() - t0}
                for n, e in engines.items():
                    row[n] = e.cache.mapped_bytes
                    row[n + ":waiting"] = e.num_waiting
                timeline.append(row)
                time.sleep(sample_every)

        mon = threading.Thread(target=monitor, daemon=True)
        mon.start()
        for a, rec in zip(trace, recs, strict=True):
            delay = a.t - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
            rec["submitted"] = time.perf_counter() - t0
            loop.submit(a.model, a.prompt, params, event(rec))
        done.wait()
        mon.join()
    return {
        "requests": recs,
        "timeline": timeline,
        "compiled_during_run": sum(e.num_compiled - compiled0[n] for n, e in engines.items()),
        "preemptions": sum(e.num_preemptions - preempt0[n] for n, e in engines.items()),
    }


def summarize(res: dict) -> dict:
    recs = res["requests"]
    errors = [r for r in recs if "error" in r]
    ok = [r for r in recs if "error" not in r]
    ttft = np.array([r["first"] - r["t"] for r in ok])
    end = max(r["end"] for r in recs)
    tokens = sum(r["n"] for r in ok)
    peak = max(
        sum(v for k, v in row.items() if k != "t" and ":" not in k) for row in res["timeline"]
    )
    per_model = {}
    for name in MODELS:
        tt = np.array([r["first"] - r["t"] for r in ok if r["model"] == name])
        per_model[name] = {
            "requests": int(tt.size),
            "ttft_p50_ms": float(np.percentile(tt, 50) * 1e3) if tt.size else None,
            "ttft_p99_ms": float(np.percentile(tt, 99) * 1e3) if tt.size else None,
            "peak_mapped_mib": max(row[name] for row in res["timeline"]) / MiB,
        }
    return {
        "requests": len(recs),
        "errors": len(errors),
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "ttft_mean_ms": float(ttft.mean() * 1e3),
        "throughput_tok_s": tokens / end,
        "peak_mapped_mib": peak / MiB,
        "preemptions": res["preemptions"],
        "compiled_during_run": res["compiled_during_run"],
        "per_model": per_model,
    }


TIER_TENANTS = ("llama-4l", "qwen-3l")


def host_tier_bursts(models, rounds: int, tier_tokens: int, seed: int = 0) -> dict:
    """Alternating bursts with prefix caching, with (``tier_tokens`` > 0) or without the
    host tier. Per round the idle tenant asks twice on its 4 shared 512-token prefixes
    (the second ask finds them all on the device: the reference), the busy tenant serves
    16 long unique prompts (more than the pool holds: it reclaims the idle tenant's idle
    cached prefixes), then the idle tenant asks again (measured). The first two rounds
    (one per tenant) warm up every step shape and are not counted."""
    rng = np.random.default_rng(seed)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    pool = kv.Pool("12MiB", page_size=64 << 10, backend="host")
    engines = {
        n: Engine(
            models[n],
            pool,
            name=n,
            max_batch=8,
            max_num_batched_tokens=128,
            max_cached_tokens=-1,
            host_cache_tokens=tier_tokens,
        )  # fmt: skip
        for n in TIER_TENANTS
    }
    prefixes = {n: [rng.integers(1, 250, 512).tolist() for _ in range(4)] for n in TIER_TENANTS}

    def ask(name):
        """The tenant's 4 requests on its prefixes: (prefix tokens found, TTFT median)."""
        ps = [p + rng.integers(1, 250, 16).tolist() for p in prefixes[name]]
        outs = engines[name].generate(ps, greedy)
        return sum(o.cached_tokens for o in outs), float(np.median([o.ttft_s for o in outs]))

    rows = []
    for r in range(rounds + 2):
        busy, idle = TIER_TENANTS[r % 2], TIER_TENANTS[1 - r % 2]
        ask(idle)
        ref_hits, ref_ttft = ask(idle)  # every prefix cached on the device
        engines[busy].generate([rng.integers(1, 250, 600).tolist() for _ in range(8)], greedy)
        hits, ttft = ask(idle)
        if r >= 2:
            rows.append(
                {"busy": busy, "idle": idle, "hits_before_burst": ref_hits,
                 "hits_after_burst": hits, "ttft_before_burst_ms": ref_ttft * 1e3,
                 "ttft_after_burst_ms": ttft * 1e3}
            )  # fmt: skip
    tiers = {n: e.stats()["host_cache"] for n, e in engines.items()}
    compiled = {n: e.num_compiled for n, e in engines.items()}
    for e in engines.values():
        e.close()
    pool.close()
    kept = sum(r["hits_after_burst"] for r in rows) / sum(r["hits_before_burst"] for r in rows)
    return {
        "tier_tokens": tier_tokens,
        "rounds": rows,
        "hits_kept": kept,
        "ttft_after_burst_ms": float(np.median([r["ttft_after_burst_ms"] for r in rows])),
        "ttft_before_burst_ms": float(np.median([r["ttft_before_burst_ms"] for r in rows])),
        "host_cache": tiers,
        "compiled_shapes": compiled,
    }


def run_host_tier(models, rounds: int) -> dict:
    out = {"without": host_tier_bursts(models, rounds, 0)}
    out["with"] = host_tier_bursts(models, rounds, 8192)
    w, wo = out["with"], out["without"]
    print("\nhost tier: alternating bursts reclaim the idle tenant's cached prefixes")
    print(f"{'idle tenant, 4 x 512-token prefixes':40}{'without tier':>14}{'with tier':>12}")
    for label, key, scale, unit in (
        ("prefix hits kept after a burst", "hits_kept", 100, "%"),
        ("TTFT after a burst (ms)", "ttft_after_burst_ms", 1, ""),
        ("TTFT before it, all on device (ms)", "ttft_before_burst_ms", 1, ""),
    ):
        print(f"{label:40}{scale * wo[key]:13.0f}{unit or ' '}{scale * w[key]:11.0f}{unit or ' '}")
    tiers = w["host_cache"].values()
    print(
        f"  with the tier: {sum(t['restores'] for t in tiers)} restores, "
        f"{sum(t['bytes_from_host'] for t in tiers) / MiB:.1f} MiB restored, "
        f"{sum(t['bytes_to_host'] for t in tiers) / MiB:.1f} MiB copied out"
    )
    ok = w["hits_kept"] >= 0.9
    print(f"hits kept with the tier: {100 * w['hits_kept']:.0f}% (goal >= 90%: "
          f"{'met' if ok else 'NOT met'})")  # fmt: skip
    return out


def plot(path, runs, budget, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ts = np.linspace(0, args.duration, 400)
    for i, name in enumerate(MODELS):
        axes[0].plot(ts, [rate(t, i, len(MODELS), args.duration, args.hi, args.lo) for t in ts],
                     label=name)  # fmt: skip
    axes[0].set_ylabel("request rate (req/s)")
    axes[0].legend(loc="upper right")
    axes[0].set_title("arrivals: alternating bursts (same trace for both)")
    for ax, config in zip(axes[1:], ("elastic", "static"), strict=True):
        tl = runs[config]["timeline"]
        t = [row["t"] for row in tl]
        ax.stackplot(t, *[[row[n] / MiB for row in tl] for n in MODELS], labels=list(MODELS))
        ax.axhline(budget / MiB, color="k", ls="--", lw=1, label="total budget")
        if config == "static":
            for k in range(1, len(MODELS)):
                ax.axhline(k * budget / len(MODELS) / MiB, color="grey", ls=":", lw=1)
        s = runs[config]["summary"]
        ax.set_title(
            f"{config}: mapped KV memory per model (TTFT p99 {s['ttft_p99_ms']:.0f} ms, "
            f"p50 {s['ttft_p50_ms']:.0f} ms)"
        )
        ax.set_ylabel("MiB mapped")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# --processes: three `serve` processes, one model each (the presets serve can build).
PROC_MODELS = {"llama": "tiny-llama", "qwen": "tiny-qwen2", "llama-b": "tiny-llama"}




def start_servers(config: str, budget: int, page: int, max_batch: int, group: str) -> dict:
    """name -> (process, url) of three servers, up and warmed (every step shape compiled;
    the persistent compilation cache makes the second configuration's start fast)."""
    import subprocess
    import sys

    import httpx
    from bench_serving import free_port

    share = budget // len(PROC_MODELS) // page * page
    servers = {}
    for i, (name, preset) in enumerate(PROC_MODELS.items()):
        port = free_port()
        flags = ServeConfig(
            models=[f"{name}={preset}"], memory=str(budget if config == "elastic" else share),
            page_size=str(page), backend="host", max_queue=10000, seed=i, port=port,
            group=group if config == "elastic" else None,
            engine=EngineConfig(max_batch=max_batch, max_cached_tokens=0),
        ).flags()  # fmt: skip
        cmd = [sys.executable, "-m", "jax_kvcached.cli", "serve", *flags]
        env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd="/"
        )
        servers[name] = (proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 900
    for name, (proc, url) in servers.items():
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server {name} exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {name} did not come up")
            time.sleep(0.5)
    return servers


def stop_servers(servers: dict) -> None:
    import signal

    for proc, _ in servers.values():
        proc.send_signal(signal.SIGINT)
    for proc, _ in servers.values():
        try:
            proc.wait(timeout=60)
        except Exception:
            proc.kill()


def run_http_trace(servers: dict, trace: list[Arrival], max_tokens: int) -> dict:
    """Streams every request of the trace at its arrival time; TTFT is the first token's
    chunk, client-side. Samples each server's mapped bytes from /metrics."""
    import httpx

    recs = [{"model": a.model, "t": a.t, "first": None, "end": None, "n": 0} for a in trace]
    timeline, done = [], threading.Event()
    t0 = time.perf_counter()

    def one(a: Arrival, rec: dict) -> None:
        body = {
            "model": a.model, "prompt": a.prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0,
        }  # fmt: skip
        try:
            with httpx.stream("POST", servers[a.model][1] + "/v1/completions", json=body,
                              timeout=600) as r:  # fmt: skip
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}"
                for line in r.iter_lines():
                    if line.startswith("data: {") and rec["first"] is None:
                        rec["first"] = time.perf_counter() - t0
                    if line == "data: [DONE]" and r.status_code == 200:
                        rec["n"] = max_tokens  # ignore_eos: every request runs to the end
        except httpx.HTTPError as e:
            rec["error"] = repr(e)
        rec["end"] = time.perf_counter() - t0
        if rec["first"] is None and "error" not in rec:
            rec["error"] = "no token"

    def monitor() -> None:
        with httpx.Client(timeout=5) as client:
            while not done.is_set():
                row = {"t": time.perf_counter() - t0}
                for name, (_, url) in servers.items():
                    for ln in client.get(url + "/metrics").text.splitlines():
                        if ln.startswith(f'kvcached_mapped_bytes{{model="{name}"}}'):
                            row[name] = float(ln.split()[-1])
                timeline.append(row)
                time.sleep(0.25)

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    threads = []
    for a, rec in zip(trace, recs, strict=True):
        delay = a.t - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(a, rec), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    done.set()
    mon.join()
    return {"requests": recs, "timeline": timeline}


def summarize_http(res: dict) -> dict:
    recs = res["requests"]
    ok = [r for r in recs if "error" not in r]
    ttft = np.array([r["first"] - r["t"] for r in ok])
    end = max(r["end"] for r in recs)
    peak = max((sum(v for k, v in row.items() if k != "t") for row in res["timeline"]), default=0)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "ttft_mean_ms": float(ttft.mean() * 1e3),
        "throughput_tok_s": sum(r["n"] for r in ok) / end,
        "peak_mapped_mib": peak / MiB,
        "per_model_p99_ms": {
            n: float(np.percentile([r["first"] - r["t"] for r in ok if r["model"] == n], 99) * 1e3)
            for n in PROC_MODELS
        },
    }


def run_processes(args, budget: int, page: int) -> dict:
    trace = make_trace(
        args.duration, args.hi, args.lo, args.prompt_len, args.seed, names=tuple(PROC_MODELS)
    )
    print(
        f"processes: {len(trace)} requests over {args.duration:.0f} s to 3 serve processes, "
        f"budget {budget / MiB:.0f} MiB, pages {page // 1024} KiB"
    )
    group = f"bench-{os.getpid()}"
    runs = {}
    try:
        for config in ("elastic", "static"):
            t0 = time.perf_counter()
            servers = start_servers(config, budget, page, args.max_batch, group)
            print(f"  {config}: 3 servers up in {time.perf_counter() - t0:.0f} s")
            try:
                res = run_http_trace(servers, trace, args.max_tokens)
            finally:
                stop_servers(servers)
            runs[config] = summarize_http(res)
    finally:
        from jax_kvcached.memory import shm_segment

        shm_segment.remove(group)
    e, s = runs["elastic"], runs["static"]
    print(f"\n{'processes':24}{'group':>10}{'static':>10}{'static/group':>14}")
    for label, key, fmt in (
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
        ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}"),
        ("throughput (tok/s)", "throughput_tok_s", "{:.0f}"),
        ("peak mapped (MiB)", "peak_mapped_mib", "{:.1f}"),
        ("errors", "errors", "{:d}"),
    ):
        ratio = s[key] / e[key] if e[key] else float("nan")
        print(f"{label:24}{fmt.format(e[key]):>10}{fmt.format(s[key]):>10}{ratio:>14.2f}")
    goal = s["ttft_p99_ms"] / e["ttft_p99_ms"]
    tput = e["throughput_tok_s"] / s["throughput_tok_s"]
    print(
        f"\np99 TTFT static/group = {goal:.2f}x (goal >= 2x: {'met' if goal >= 2 else 'NOT met'})"
        f"; throughput group/static = {tput:.2f}"
    )
    return {"requests": len(trace), "group": e, "static": s, "p99_ttft_ratio": goal,
            "throughput_ratio": tput}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.join(os.path.dirname(__file__), "results")
    p.add_argument("--out", default=os.path.join(here, "bench_multitenant.json"))
    p.add_argument("--budget", default="6MiB", help="total KV budget of both configurations")
    p.add_argument("--page-size", default="64KiB")
    p.add_argument("--duration", type=float, default=48.0, help="seconds of arrivals")
    p.add_argument("--hi", type=float, default=8.0, help="peak request rate of a burst")
    p.add_argument("--lo", type=float, default=0.2, help="rate outside a model's burst")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128))
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a short run (12 s of arrivals)")
    p.add_argument(
        "--host-tier", action="store_true",
        help="only the host-tier section (alternating bursts with prefix caching)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=6, help="bursts in the host-tier section")
    p.add_argument(
        "--processes", action="store_true",
        help="only the process section: three serve processes, one group vs static partitions",
    )  # fmt: skip
    args = p.parse_args()
    if args.quick:
        args.duration = 12.0
    budget = kv.parse_bytes(args.budget)
    page = kv.parse_bytes(args.page_size)
    if args.processes:
        res = run_processes(args, budget, page)
        out = os.path.join(os.path.dirname(args.out), "bench_multitenant_processes.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "out"}, **res}, f,
                      indent=1)  # fmt: skip
        print(f"wrote {out}")
        return
    models = {n: build_model(c, seed=i) for i, (n, c) in enumerate(MODELS.items())}
    if args.host_tier:
        tier = run_host_tier(models, args.rounds)
        out = os.path.join(os.path.dirname(args.out), "bench_multitenant_host_tier.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(tier, f, indent=1)
        print(f"wrote {out}")
        return
    trace = make_trace(args.duration, args.hi, args.lo, args.prompt_len, args.seed)
    print(
        f"{len(trace)} requests over {args.duration:.0f} s, budget {budget / MiB:.0f} MiB, "
        f"pages {page // 1024} KiB, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
        f"{args.max_tokens} output tokens"
    )
    runs = {}
    for config in ("elastic", "static"):
        engines, pools = build(config, budget, page, args.max_batch, models)
        t0 = time.perf_counter()
        for engine in engines.values():
            engine.compile()  # every step shape it can run: serving compiles nothing
        print(f"  {config}: compiled in {time.perf_counter() - t0:.0f} s")
        res = run_trace(engines, trace, args.max_tokens)
        res["summary"] = summarize(res)
        runs[config] = res
        for e in engines.values():
            e.close()
        for pool in pools:
            pool.close()
    e, s = runs["elastic"]["summary"], runs["static"]["summary"]
    rows = [
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
        ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}"),
        ("throughput (tok/s)", "throughput_tok_s", "{:.0f}"),
        ("peak mapped (MiB)", "peak_mapped_mib", "{:.1f}"),
        ("preemptions", "preemptions", "{:d}"),
        ("errors", "errors", "{:d}"),
        ("shapes compiled in run", "compiled_during_run", "{:d}"),
    ]
    print(f"\n{'':24}{'elastic':>10}{'static':>10}{'static/elastic':>16}")
    for label, key, fmt in rows:
        ratio = s[key] / e[key] if e[key] else float("nan")
        print(f"{label:24}{fmt.format(e[key]):>10}{fmt.format(s[key]):>10}{ratio:>16.2f}")
    print("\nper model TTFT p99 (ms):")
    for name in MODELS:
        pe, ps = e["per_model"][name], s["per_model"][name]
        print(
            f"  {name:10} elastic {pe['ttft_p99_ms']:8.0f}  static {ps['ttft_p99_ms']:8.0f}  "
            f"peak mapped {pe['peak_mapped_mib']:.1f} vs {ps['peak_mapped_mib']:.1f} MiB"
        )
    goal = s["ttft_p99_ms"] / e["ttft_p99_ms"]
    print(
        f"\np99 TTFT static/elastic = {goal:.2f}x (goal >= 2x: {'met' if goal >= 2 else 'NOT met'})"
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(png, runs, budget, args)
    out = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "budget_bytes": budget,
        "requests": len(trace),
        "elastic": e,
        "static": s,
        "p99_ttft_ratio": goal,
        "timelines": {c: runs[c]["timeline"] for c in runs},
        "host_tier": run_host_tier(models, 2 if args.quick else args.rounds),
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
