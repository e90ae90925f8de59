"""Decode and prefill throughput: the paged engine step vs a dense, donated KV cache; the
step loop's host share, bucket sweep, sampling cost and server start.

Both run the same Flax model and the same attention math; they differ only in where K/V
live: the paged step gathers blocks from the virtual KV buffer through block tables and
writes new K/V with one FFI call, the dense step keeps an XLA-owned contiguous
``(layers, 2, batch, max_len, kv_heads, head_dim)`` cache, donated every step (the
Flax / MaxText approach). Step times are medians of interleaved rounds, so machine noise
hits both alike. Prints a table and writes JSON (benchmarks/results/bench_decode.json).

``--parts loop``: the engine's decode step (overlapped and synchronous) vs the compiled
step alone (step + sampler dispatched back to back: no host work); step time across
adjacent buckets; on-device sampling vs argmax; ``jax-kvcached serve`` cold and warm
start (persistent compilation cache) to the first answer.

``--tp 1,2,4``: tensor parallelism on forced host devices (``--parts`` is then only
this): the same requests through an engine over 1, 2 and 4 devices; peak mapped bytes
per device, step time and tokens/s per TP size, outputs compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request


def _force_host_devices(argv: list[str]) -> None:
    """``--tp`` needs that many CPU devices, which must be requested before JAX starts."""
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--tp=") else None
        if a == "--tp" and i + 1 < len(argv):
            value = argv[i + 1]
        if value:
            n = max(int(x) for x in value.split(","))
            flag = f"--xla_force_host_platform_device_count={n}"
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


_force_host_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_common import load_model, median_time  # noqa: E402
from flax import nnx  # noqa: E402

import jax_kvcached as kv  # noqa: E402
from jax_kvcached.engine.attention import gqa_attention  # noqa: E402
from jax_kvcached.engine.engine import Engine  # noqa: E402
from jax_kvcached.engine.launches import Launches  # noqa: E402
from jax_kvcached.engine.runner import ModelRunner, StepInput  # noqa: E402
from jax_kvcached.engine.sampling import SamplingParams, sample  # noqa: E402
from jax_kvcached.engine.step_layout import logit_rows  # noqa: E402
from jax_kvcached.models import BUILTIN_CONFIGS, build_model  # noqa: E402
from jax_kvcached.models.stack import LayerList, stacked_leaves  # noqa: E402
from jax_kvcached.serve.config import ServeConfig  # noqa: E402


def make_dense_step(model, max_len: int):
    graphdef, state = nnx.split(model)
    cfg = model.config
    windows = cfg.layer_windows()
    # Unrolled over per-layer weight arrays, as the engine runs on a CPU (XLA:CPU copies
    # every slice of a stacked weight): every layer index static.
    leaves, treedef = jax.tree.flatten(state)
    stacked = stacked_leaves(state)
    weights = [list(x) if f else x for x, f in zip(leaves, stacked, strict=True)]

    def step(weights, cache, tokens, pos):
        leaves = [LayerList(w) if f else w for w, f in zip(weights, stacked, strict=True)]
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        b = tokens.shape[0]

        def attend(i, q, k, v, c):  # the cache is the layers' carry (donated: in place)
            c = jax.lax.dynamic_update_slice(c, k[None, None].astype(c.dtype), (i, 0, 0, pos, 0, 0))
            c = jax.lax.dynamic_update_slice(c, v[None, None].astype(c.dtype), (i, 1, 0, pos, 0, 0))
            seen = jnp.arange(max_len) <= pos
            if any(windows):  # a sliding-window layer sees its last `window` keys
                w = jnp.asarray(windows)[i]
                seen &= (w == 0) | (jnp.arange(max_len) > pos - w)
            mask = jnp.broadcast_to(seen[None, None], (b, 1, max_len))
            return gqa_attention(q, c[i, 0], c[i, 1], mask), c

        positions = jnp.full((b, 1), pos, jnp.int32)
        hidden, cache = m.hidden_states(tokens, positions, attend, cache)
        logits = m.logits(hidden[:, -1])
        return (logits, jnp.argmax(logits, -1)), cache  # greedy, as the paged step samples

    fn = jax.jit(step, donate_argnums=1)
    shape = (cfg.num_layers, 2, 0, max_len, cfg.num_kv_heads, cfg.head_dim)
    return fn, weights, shape


def bench_decode(
    model, batch: int, ctx: int, iters: int, rounds: int, backend: str = "host"
) -> dict:
    cfg = model.config
    bs = 16
    dtype = jnp.dtype(model.dtype)
    itemsize = dtype.itemsize
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    need = batch * (ctx + bs) * kv_per_token
    one_kv_page = 2 * cfg.num_layers * (2 << 20)  # one 2 MiB page per layer for K and V
    pool = kv.Pool(
        max(2 * need, 4 * one_kv_page), backend=backend, min_reserved_pages=0,
        max_reserved_pages=0,
    )  # fmt: skip
    cache = pool.create_kv_cache(
        "bench", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype.name, block_size=bs
    )
    runner = ModelRunner(model, cache, max_batch=batch, max_model_len=ctx + 2 * bs)
    tables = [cache.alloc(-(-(ctx + 1) // bs)).tolist() for _ in range(batch)]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, batch).tolist()
    inputs = [StepInput([tokens[i]], ctx, tables[i]) for i in range(batch)]

    def paged():  # (run_padded: run() slices the logits, one more dispatch a step)
        jax.block_until_ready(runner.run_padded(inputs))

    max_len = ctx + bs  # the dense cache is sized for the context it serves
    dense_fn, state, shape = make_dense_step(model, max_len)
    d_cache = {"c": jnp.zeros((shape[0], 2, batch, max_len, shape[4], shape[5]), dtype)}
    d_tokens = jnp.asarray(np.asarray(tokens, np.int32)[:, None])
    d_pos = jnp.int32(ctx)

    def dense():
        out, d_cache["c"] = dense_fn(state, d_cache["c"], d_tokens, d_pos)
        jax.block_until_ready(out)

    for fn in (paged, dense):  # compile + warm up
        fn()
        fn()
    tp, td = [], []
    for _ in range(rounds):
        tp.append(median_time(paged, iters))
        td.append(median_time(dense, iters))
    p, d = float(np.median(tp)), float(np.median(td))
    kv_bytes = batch * ctx * kv_per_token
    pool.close()
    return {
        "batch": batch,
        "ctx": ctx,
        "paged_step_ms": p * 1e3,
        "dense_step_ms": d * 1e3,
        "paged_over_dense": p / d,
        "paged_tokens_per_s": batch / p,
        "dense_tokens_per_s": batch / d,
        "paged_kv_read_gbps": kv_bytes / p / 1e9,
        "dense_kv_read_gbps": kv_bytes / d / 1e9,
    }


def bench_prefill(model, chunk: int, iters: int, backend: str = "host") -> dict:
    cfg = model.config
    pool = kv.Pool("256MiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
    cache = pool.create_kv_cache(
        "prefill", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(model.dtype).name
    )
    runner = ModelRunner(model, cache, max_num_batched_tokens=chunk, max_model_len=chunk + 16)
    blocks = cache.alloc(-(-chunk // 16)).tolist()
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, chunk).tolist()
    x = [StepInput(toks, 0, blocks)]
    jax.block_until_ready(runner.run(x))
    t = median_time(lambda: jax.block_until_ready(runner.run(x)), iters)
    pool.close()
    return {"chunk": chunk, "step_ms": t * 1e3, "tokens_per_s": chunk / t}


def memcpy_gbps(mib: int = 256, backend: str = "host") -> float:
    """Copy bandwidth of the memory the KV cache lives in: host RAM, or the GPU's."""
    if backend == "cuda":
        x = jnp.ones(mib << 20 >> 2, jnp.float32)
        copy = jax.jit(lambda a: a + 0.0)
        jax.block_until_ready(copy(x))
        return x.nbytes / median_time(lambda: jax.block_until_ready(copy(x)), 5) / 1e9
    a = np.ones(mib << 18, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = median_time(lambda: np.copyto(b, a), 5)
    return a.nbytes / t / 1e9


def _host_pool(size: str = "512MiB") -> kv.Pool:
    return kv.Pool(size, backend="host", min_reserved_pages=0, max_reserved_pages=0)


def _time_steps(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _compiled_step_s(runner: ModelRunner, inputs: list[StepInput], steps: int) -> float:
    """Seconds per step of the compiled step (and sampler) alone, dispatched back to back."""
    jax.block_until_ready(runner.run_padded(inputs))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = runner.run_padded(inputs)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def bench_host_share(batch: int, rounds: int, prompt_len: int = 64, steps: int = 32) -> dict:
    """Decode step of the engine (overlapped, synchronous) vs the compiled step alone, on
    the built-in tiny Llama (the issue's profile: prompt 64, 96 new tokens)."""
    model = build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0)
    pool = _host_pool()
    eng = Engine(model, pool, max_batch=batch, max_num_batched_tokens=64, prefix_caching=False)
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=prompt_len + 3 * steps, ignore_eos=True, seed=1)

    def engine_step_s(overlap: bool) -> float:
        eng.overlap = overlap
        for _ in range(batch):
            eng.add_request(rng.integers(1, 300, prompt_len).tolist(), params)
        while any(s.num_output == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        for _ in range(3):
            eng.step()
        t = _time_steps(eng.step, steps)
        for s in list(eng.scheduler.running):
            eng.abort(s.request_id)
        eng.drain()
        return t

    runner = eng.runner
    tables = [eng.cache.alloc(-(-(prompt_len + 40) // 16)).tolist() for _ in range(batch)]
    inputs = [
        StepInput([5], prompt_len + 8, tables[i], params=params, sample_step=8)
        for i in range(batch)
    ]

    def jitted_step_s() -> float:
        return _compiled_step_s(runner, inputs, steps)

    engine_step_s(True), engine_step_s(False), jitted_step_s()  # compile, warm up
    over, sync, alone = [], [], []
    for _ in range(rounds):
        over.append(engine_step_s(True))
        sync.append(engine_step_s(False))
        alone.append(jitted_step_s())
    o, s_, j = (float(np.median(x)) for x in (over, sync, alone))
    eng.cache.free([b for t in tables for b in t], after=runner.token)
    pool.close()
    return {
        "batch": batch, "engine_step_ms": o * 1e3, "sync_engine_step_ms": s_ * 1e3,
        "jitted_step_ms": j * 1e3, "engine_over_jitted": o / j, "sync_over_jitted": s_ / j,
    }  # fmt: skip


def bench_launches(
    model, backend: str, batches: list[int], rounds: int, steps: int = 24, prompt_len: int = 32
) -> list[dict]:
    """The engine's decode step, per step: programs dispatched, launches of the step
    program run op by op (greedy: the sampler's cheapest branch; and the costliest),
    wall time, the host's share (everything but waiting for the device's tokens) and the
    dispatch alone. Side by side: on CUDA command buffers on and off (sampling fused),
    on a CPU sampling fused into the step or dispatched behind it."""
    cfg = model.config
    # (command_buffers, fuse_sampling)
    settings = ((True, True), (False, True)) if backend == "cuda" else ((None, True), (None, False))
    max_len = prompt_len + steps * (rounds + 1) + 16
    rows = []
    for b in batches:
        engines = {}
        for cb in settings:
            pool = kv.Pool("1GiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
            engines[cb] = Engine(model, pool, max_batch=b, prefix_caching=False,
                                 max_model_len=max_len, command_buffers=cb[0],
                                 fuse_sampling=cb[1])  # fmt: skip
        timing: dict = {cb: {"wall": [], "dispatch": [], "wait": []} for cb in settings}
        rng = np.random.default_rng(b)
        params = SamplingParams(max_tokens=max_len - prompt_len, ignore_eos=True)
        for eng in engines.values():
            for _ in range(b):
                eng.add_request(rng.integers(1, cfg.vocab_size, prompt_len).tolist(), params)
            while any(s.num_output == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
                eng.step()
            for _ in range(3):
                eng.step()  # every shape of the decode steps compiled
        for _ in range(rounds):
            for cb, eng in engines.items():
                spent = {"dispatch": 0.0, "wait": 0.0}
                dispatch, fetch = eng.dispatch, eng.runner.fetch

                def timed_dispatch(dispatch=dispatch, spent=spent):
                    t0 = time.perf_counter()
                    out = dispatch()
                    spent["dispatch"] += time.perf_counter() - t0
                    return out

                def timed_fetch(x, fetch=fetch, spent=spent):
                    t0 = time.perf_counter()
                    out = fetch(x)
                    spent["wait"] += time.perf_counter() - t0
                    return out

                eng.dispatch, eng.runner.fetch = timed_dispatch, timed_fetch
                n0, d0 = eng.steps, eng.runner.dispatches
                t0 = time.perf_counter()
                for _ in range(steps):
                    eng.step()
                wall = time.perf_counter() - t0
                del eng.dispatch, eng.runner.fetch  # the methods again
                n = eng.steps - n0
                timing[cb]["wall"].append(wall / n)
                timing[cb]["dispatch"].append(spent["dispatch"] / n)
                timing[cb]["wait"].append(spent["wait"] / n)
                timing[cb]["programs"] = (eng.runner.dispatches - d0) / n
        for cb, eng in engines.items():
            med = {k: float(np.median(v)) for k, v in timing[cb].items() if k != "programs"}
            seqs = list(eng.scheduler.running)
            shape = eng.runner.shapes_for(
                [StepInput([1], s.num_computed, s.tables[0]) for s in seqs]
            )
            launches = eng.runner.launches(shape)
            if not eng.runner.step_spec.fused(shape[0]):  # plus the sampler behind it
                extra = eng.runner.launches(logit_rows(shape[0], eng.runner.max_rows))
                launches = Launches(*(a + b for a, b in zip(dataclasses.astuple(launches),
                                                            dataclasses.astuple(extra),
                                                            strict=True)))  # fmt: skip
            rows.append({
                "batch": b, "command_buffers": {None: "n/a", True: "on", False: "off"}[cb[0]],
                "fused_sampling": cb[1],
                "step_ms": med["wall"] * 1e3, "tokens_per_s": b / med["wall"],
                "host_ms": (med["wall"] - med["wait"]) * 1e3, "dispatch_ms": med["dispatch"] * 1e3,
                "wait_ms": med["wait"] * 1e3, "programs_per_step": timing[cb]["programs"],
                "launches_greedy": launches.least, "launches_most": launches.most,
                "conditionals": launches.conditionals, "loops": launches.loops,
            })  # fmt: skip
            for s in seqs:
                eng.abort(s.request_id)
            eng.drain()
            eng.close()
            eng.pool.close()
    print(f"\nDecode step launches and host time ({backend} backend, {jax.devices()[0]}): "
          "engine steps, overlapped; launches of the step program run op by op")  # fmt: skip
    print(f"{'batch':>5} {'graphs':>6} {'fused':>6} {'step ms':>8} {'tok/s':>8} {'host ms':>8} "
          f"{'dispatch':>9} {'wait ms':>8} {'programs':>9} {'launches':>9} {'(most)':>7} "
          f"{'conds':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']:>5} {r['command_buffers']:>6} {str(r['fused_sampling']):>6} "
              f"{r['step_ms']:>8.2f} "
              f"{r['tokens_per_s']:>8.0f} {r['host_ms']:>8.2f} {r['dispatch_ms']:>9.2f} "
              f"{r['wait_ms']:>8.2f} {r['programs_per_step']:>9.2f} {r['launches_greedy']:>9} "
              f"{r['launches_most']:>7} {r['conditionals']:>6}")  # fmt: skip
    return rows


def bench_buckets(model, rounds: int, steps: int = 20) -> list[dict]:
    """Decode step time at contexts and batch sizes either side of a bucket edge."""
    pool = _host_pool("1GiB")
    cfg = model.config
    cache = pool.create_kv_cache("b", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32")
    runner = ModelRunner(model, cache, max_batch=32, max_model_len=4096)
    points = [(8, c) for c in (1008, 1024, 1040, 1100)] + [(b, 1024) for b in (15, 16, 17, 20)]
    tables = [cache.alloc(-(-1200 // 16)).tolist() for _ in range(20)]
    p = SamplingParams(seed=0)
    cases = {(b, c): [StepInput([3], c, tables[i], params=p) for i in range(b)] for b, c in points}

    def run(x):
        return _compiled_step_s(runner, x, steps)

    times = {k: [] for k in cases}
    for x in cases.values():
        run(x)
    for _ in range(rounds):
        for k, x in cases.items():
            times[k].append(run(x))
    rows = []
    for b, c in points:
        rows.append({
            "batch": b, "ctx": c, "shape": list(runner.shapes_for(cases[b, c])),
            "step_ms": float(np.median(times[b, c])) * 1e3,
        })  # fmt: skip
    for prev, r in zip(rows, rows[1:], strict=False):
        same_axis = prev["batch"] == r["batch"] or prev["ctx"] == r["ctx"]
        r["over_previous"] = r["step_ms"] / prev["step_ms"] if same_axis else None
    rows[0]["over_previous"] = rows[4]["over_previous"] = None
    pool.close()
    return rows


def _samplers(b: int) -> dict:
    """The sampling cases of 32 rows, each a function of the logits."""
    fn = jax.jit(sample)
    argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1))
    zero, one = jnp.zeros(b), jnp.ones(b)
    k0 = steps = jnp.zeros(b, jnp.int32)
    seeds = jnp.arange(b, dtype=jnp.uint32)
    return {
        "argmax": argmax,
        "greedy": lambda x: fn(x, zero, k0, one, seeds, steps),
        "top_k=50": lambda x: fn(x, one, k0 + 50, one, seeds, steps),
        "top_p=0.9": lambda x: fn(x, one, k0, one * 0.9, seeds, steps),
        "temperature only": lambda x: fn(x, one, k0, one, seeds, steps),
    }


def bench_sampling(rounds: int, iters: int = 20) -> list[dict]:
    """On-device sampling of 32 rows vs a bare argmax. ``peaked``: N(0, 12^2) logits, the
    64 candidates hold the top-p mass (the usual case for a trained model); ``flat``:
    N(0, 1) logits, top-p reaches past them (the exact whole-vocabulary path)."""
    rows = []
    cases = _samplers(32)
    for v in (32000, 49152):
        base = jax.random.normal(jax.random.PRNGKey(v), (32, v))
        for kind, scale in (("peaked", 12.0), ("flat", 1.0)):
            x = base * scale
            t: dict[str, list[float]] = {k: [] for k in cases}
            for f in cases.values():
                jax.block_until_ready(f(x))
            for _ in range(rounds):
                for k, f in cases.items():
                    t[k].append(median_time(lambda f=f, x=x: jax.block_until_ready(f(x)), iters))
            ref = float(np.median(t["argmax"]))
            for k in cases:
                m = float(np.median(t[k]))
                rows.append({
                    "vocab": v, "logits": kind, "sampler": k, "ms": m * 1e3,
                    "over_argmax": m / ref,
                })  # fmt: skip
    return rows


def bench_start(models: list[str], cache_dir: str) -> dict:
    """Seconds from launching ``jax-kvcached serve`` to every model's first answer."""
    with socket_port() as port:
        pass  # a free port, released for the server
    config = ServeConfig(models=list(models), backend="host", port=port,
                         compile_cache=cache_dir, memory="512MiB")
    cmd = [sys.executable, "-m", "jax_kvcached.cli", "serve", *config.flags()]
    t0 = time.perf_counter()
    proc = subprocess.Popen(  # run outside the checkout: the installed package
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        cwd=tempfile.gettempdir(),
    )  # fmt: skip
    try:
        for spec in models:
            name = spec.split("=")[0]
            body = json.dumps({"model": name, "prompt": "hello", "max_tokens": 4}).encode()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited: {proc.stderr.read()[-2000:]}")
                try:
                    req = urllib.request.Request(
                        f"http://127.0.0.1:{port}/v1/completions", body,
                        {"Content-Type": "application/json"},
                    )  # fmt: skip
                    urllib.request.urlopen(req, timeout=120).read()
                    break
                except OSError:
                    time.sleep(0.05)
        return {"models": models, "first_answer_s": time.perf_counter() - t0}
    finally:
        proc.terminate()
        proc.wait(30)


class socket_port:
    """A free loopback port (closed again on exit)."""

    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.s.close()


def bench_write(backend: str, rounds: int, steps: int = 50) -> list[dict]:
    """The step's K/V write (30 layers, 32 rows) run back to back: ``write_kv`` (on CUDA it
    copies layer and slots to the host and synchronizes the stream) vs ``write_kv_async``
    (no host round trip). On the host backend both validate on the host."""
    pool = kv.Pool("1GiB", backend=backend, min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("w", 30, 3, 64, "float32")
    ids = c.alloc(8)
    slots = jax.device_put(jnp.asarray(c.slot_mapping(ids, np.arange(32))), pool.device)
    k = jax.device_put(jnp.ones((30, 32, 3, 64), jnp.float32), pool.device)
    fns = {
        "write_kv": jax.jit(lambda c, k, s, t: kv.ops.write_kv(c, 0, k, k, s, t)),
        "write_kv_async": jax.jit(lambda c, k, s, t: kv.ops.write_kv_async(c, 0, k, k, s, t)),
    }
    times: dict[str, list[float]] = {n: [] for n in fns}
    token = jax.device_put(kv.ops.new_token(), pool.device)
    for _ in range(rounds + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                token = fn(c, k, slots, token)
            jax.block_until_ready(token)
            times[name].append((time.perf_counter() - t0) / steps)
    c.free(ids)
    pool.close()
    rows = [{"backend": backend, "op": n, "us": float(np.median(t[1:])) * 1e6}
            for n, t in times.items()]  # fmt: skip
    for r in rows:
        print(f"  {backend} {r['op']:<15} {r['us']:9.1f} us per step")
    return rows


def bench_loop(model, rounds: int, start_models: list[str]) -> dict:
    out: dict = {"host_share": [bench_host_share(b, rounds) for b in (1, 8, 32)]}
    print("\nEngine decode step vs the compiled step alone (tiny-llama, prompt 64)")
    print(f"{'batch':>5} {'engine ms':>10} {'sync ms':>8} {'jitted ms':>10} {'engine/jit':>11} "
          f"{'sync/jit':>9}")  # fmt: skip
    for r in out["host_share"]:
        print(
            f"{r['batch']:>5} {r['engine_step_ms']:>10.2f} {r['sync_engine_step_ms']:>8.2f} "
            f"{r['jitted_step_ms']:>10.2f} {r['engine_over_jitted']:>11.2f} "
            f"{r['sync_over_jitted']:>9.2f}"
        )
    out["buckets"] = bench_buckets(model, rounds)
    print("\nBucket sweep (decode step, compiled step alone)")
    for r in out["buckets"]:
        ratio = "" if r["over_previous"] is None else f"{r['over_previous']:.2f}x"
        print(f"  B={r['batch']:>2} ctx={r['ctx']:>4} shape={tuple(r['shape'])}: "
              f"{r['step_ms']:.2f} ms {ratio}")  # fmt: skip
    out["sampling"] = bench_sampling(rounds)
    print("\nSampling 32 rows on the device")
    for r in out["sampling"]:
        print(f"  V={r['vocab']:>5} {r['logits']:<6} {r['sampler']:<17} {r['ms']:7.2f} ms "
              f"{r['over_argmax']:5.2f}x argmax")  # fmt: skip
    cache_dir = tempfile.mkdtemp(prefix="kvcached-xla-")
    cold = bench_start(start_models, cache_dir)
    warm = bench_start(start_models, cache_dir)
    out["start"] = {"cold_s": cold["first_answer_s"], "warm_s": warm["first_answer_s"],
                    "models": start_models}  # fmt: skip
    print(
        f"\nserve {' '.join(start_models)}: cold start to first answers "
        f"{cold['first_answer_s']:.1f} s, warm (compile cache) {warm['first_answer_s']:.1f} s"
    )
    return out


def bench_tp(model_name: str, sizes: list[int], rounds: int) -> list[dict]:
    """The same requests through engines over 1, 2, 4... host devices: peak mapped bytes
    per device, step time, tokens/s; interleaved rounds, medians."""
    # 16 sequences of 944 + 48 tokens = 62 blocks each, all resident at once: 992 blocks,
    # 8 KV pages of 2 MiB planes on one device (128 blocks a page), 2 on each of four.
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(944)] for i in range(16)]
    params = SamplingParams(max_tokens=48)
    engines = {}
    for tp in sizes:
        pool = kv.Pool("1GiB", backend="host", devices=jax.devices("cpu")[:tp],
                       min_reserved_pages=0, max_reserved_pages=0)  # fmt: skip
        eng = Engine(load_model(model_name), pool, max_batch=16, max_num_batched_tokens=256,
                     max_model_len=1024)  # fmt: skip
        eng.generate(prompts, params)  # compiles the shapes this run uses
        eng.reset_prefix_cache()
        engines[tp] = eng
    times: dict[int, list[float]] = {tp: [] for tp in sizes}
    peak: dict[int, list[int]] = {tp: [0] * tp for tp in sizes}
    outs: dict[int, list] = {}
    steps: dict[int, int] = {}
    for _ in range(rounds):
        for tp, eng in engines.items():
            ids = [eng.add_request(p, params) for p in prompts]
            t0, n0 = time.perf_counter(), eng.steps
            done = {}
            while eng.has_work:
                for o in eng.step():
                    done[o.request_id] = o.output
                per = list(eng.pool.mapped_pages_per_device().values())
                peak[tp] = [max(a, b) for a, b in zip(peak[tp], per, strict=True)]
            times[tp].append(time.perf_counter() - t0)
            steps[tp] = eng.steps - n0
            outs[tp] = [done[i] for i in ids]
            eng.reset_prefix_cache()
    rows = []
    page = engines[sizes[0]].pool.page_size
    base = max(peak[sizes[0]]) * page
    for tp in sizes:
        t = float(np.median(times[tp]))
        per_dev = max(peak[tp]) * page
        rows.append({
            "tp": tp, "peak_mapped_bytes_per_device": per_dev,
            "per_device_over_tp1": per_dev / base, "every_device_equal": len(set(peak[tp])) == 1,
            "step_ms": 1e3 * t / steps[tp], "tokens_per_s": sum(map(len, outs[tp])) / t,
            "outputs_equal_tp1": outs[tp] == outs[sizes[0]],
        })  # fmt: skip
        engines[tp].close()
        engines[tp].pool.close()
    print(f"\nTensor parallelism, {model_name}, host devices on {os.cpu_count()} cores: "
          "16 requests of 944 prompt tokens + 48 generated, all at once")  # fmt: skip
    print(f"{'TP':>3} {'peak MiB/device':>16} {'vs TP=1':>8} {'step ms':>8} {'tok/s':>7} "
          f"{'same tokens':>12}")  # fmt: skip
    for r in rows:
        print(
            f"{r['tp']:>3} {r['peak_mapped_bytes_per_device'] / 2**20:>16.1f} "
            f"{r['per_device_over_tp1']:>8.3f} {r['step_ms']:>8.1f} {r['tokens_per_s']:>7.0f} "
            f"{str(r['outputs_equal_tp1']):>12}"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ctx", default="256,1024,2048")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="bench", help="bench (random, small) or smollm2-135m")
    p.add_argument("--parts", default="decode,loop",
                   help="decode (+prefill), loop, launches, write (a list)")  # fmt: skip
    p.add_argument("--dtype", default="float32", help="the model's and KV cache's dtype")
    p.add_argument("--quantization", default="none",
                   help="none (full precision), packed (a GGUF's own), int8 or int4")  # fmt: skip
    p.add_argument("--no-prefill", action="store_true", help="--parts decode without prefill")
    p.add_argument(
        "--backend",
        default="host",
        help="the paged cache of --parts decode and write: host or cuda",
    )
    p.add_argument(
        "--start-models", default="a=tiny-llama,b=tiny-qwen2",
        help="the models of the serve cold/warm start measurement",
    )  # fmt: skip
    here = os.path.dirname(__file__)
    p.add_argument("--out", default=None, help="default results/bench_decode[_MODEL].json")
    p.add_argument(
        "--tp", default=None, metavar="1,2,4",
        help="only the tensor-parallel comparison over these device counts (host devices)",
    )  # fmt: skip
    args = p.parse_args()
    suffix = "" if args.model == "bench" else "_" + args.model.replace(":", "-")
    quantization = None if args.quantization == "packed" else args.quantization
    if args.quantization != "none":
        suffix += "_" + args.quantization
    if args.tp:
        out = args.out or os.path.join(here, "results", f"bench_decode_tp{suffix}.json")
        sizes = [int(x) for x in args.tp.split(",")]
        _write(out, {"model": args.model, "tp": bench_tp(args.model, sizes, args.rounds)})
        return
    args.out = args.out or os.path.join(here, "results", f"bench_decode{suffix}.json")

    model = load_model(args.model, args.dtype, quantization)
    parts = set(args.parts.split(","))
    result: dict = {"model": args.model, "quantization": args.quantization, "jax": jax.__version__}
    if "write" in parts:
        print(f"\nK/V write of a step, {args.backend} backend")
        result["write"] = bench_write(args.backend, args.rounds)
    if "loop" in parts:
        result["loop"] = bench_loop(model, args.rounds, args.start_models.split(","))
    if "launches" in parts:
        batches = [int(x) for x in args.batches.split(",")]
        result["launches"] = bench_launches(model, args.backend, batches, args.rounds)
    if "decode" not in parts:
        _write(args.out, result)
        return
    rows = [
        bench_decode(model, b, c, args.iters, args.rounds, args.backend)
        for c in map(int, args.ctx.split(","))
        for b in map(int, args.batches.split(","))
    ]
    chunks = () if args.no_prefill else (128, 512)
    prefill = [bench_prefill(model, n, args.iters, args.backend) for n in chunks]
    copy = memcpy_gbps(backend=args.backend)
    cfg = model.config
    print(
        f"\nDecode ({args.backend} backend, {jax.devices()[0]}), {args.model}: "
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads x {cfg.head_dim}, {args.dtype}, "
        "one token per sequence"
    )
    print(
        f"{'batch':>5} {'ctx':>5} {'paged ms':>9} {'dense ms':>9} {'paged/dense':>12} "
        f"{'paged tok/s':>12} {'KV GB/s paged':>14} {'dense':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ctx']:>5} {r['paged_step_ms']:>9.2f} {r['dense_step_ms']:>9.2f} "
            f"{r['paged_over_dense']:>12.2f} {r['paged_tokens_per_s']:>12.0f} "
            f"{r['paged_kv_read_gbps']:>14.2f} {r['dense_kv_read_gbps']:>7.2f}"
        )
    worst = max(r["paged_over_dense"] for r in rows)
    print(f"worst paged/dense {worst:.2f} (goal <= 1.10); memcpy bandwidth {copy:.1f} GB/s")
    if prefill:
        print("\nPrefill (one sequence, one chunk, paged)")
    for r in prefill:
        print(f"  {r['chunk']:>4} tokens: {r['step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s")
    result.update({"decode": rows, "prefill": prefill, "memcpy_gbps": copy})
    _write(args.out, result)


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
