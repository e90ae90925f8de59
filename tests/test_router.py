"""``serve`` replicas behind real routers on loopback: the Shepherd Model Gateway
(``smg``, its ``cache_aware`` policy and the load figures it polls from ``/metrics``) and
vLLM's router (``kv_aware``, fed by our KV-cache events over ZMQ). Two replicas of a
small random model; one module, the replicas started once."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time

import httpx
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
from bench_router import ADMIN, Router, counters, port_pair, smg, vllm_router  # noqa: E402
from bench_serving import Server, free_port  # noqa: E402
from conftest import COMPILE_CACHE  # noqa: E402

from jax_kvcached.engine.config import EngineConfig  # noqa: E402
from jax_kvcached.serve.config import ServeConfig  # noqa: E402

# smg and vllm-router come with the test extra: a missing one fails the tests that need it
# (CI must not pass without them), naming what to install.
SMG = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
VLLM_ROUTER = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                          "vllm-router")  # fmt: skip
for _exe in (SMG, VLLM_ROUTER):
    assert os.path.exists(_exe), f"{_exe} is not installed: pip install -e '.[test]'"
HEADS = [f"Family {f}: " + " ".join(["alpha beta gamma delta"] * 30) for f in "AB"]


@pytest.fixture(scope="module")
def replicas():
    cache = COMPILE_CACHE  # the session's: the second replica starts from the first's
    events = [port_pair(), port_pair()]
    out = []
    try:
        for port in events:  # one after the other: the second starts from the compile cache
            w = Server(sys.executable, "m=tiny-llama", [], cache, ServeConfig(
                admin_key=ADMIN, warmup=False, engine=EngineConfig(
                    max_cached_tokens=-1, max_batch=2, kv_events=f"tcp://*:{port}",
                    kv_events_replay=f"tcp://*:{port + 1}")))  # fmt: skip
            out.append(w)
            w.first_answer()
        yield out, events
    finally:
        for w in out:
            w.stop()


def reset(workers):
    for i, w in enumerate(workers):  # (vLLM's form with no body; ours naming the model)
        r = httpx.post(w.url + "/reset_prefix_cache", timeout=60,
                       json={"model": "m"} if i else None,
                       headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        r.raise_for_status()
        assert r.json()["evicted_blocks"].keys() == {"m"}


def ask(router: Router, n: int) -> list[str]:
    texts = []
    for i in range(n):
        prompt = HEADS[i % 2] + f"\nQuestion {i}:"
        r = httpx.post(router.url + "/v1/completions", timeout=120,
                       json={"model": "m", "prompt": prompt, "max_tokens": 2,
                             "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def served_by(workers) -> list[float]:
    """Prompt tokens each replica looked up (which one served what)."""
    out = []
    for w in workers:
        text = httpx.get(w.url + "/metrics", timeout=30).text
        out.append(float(re.search(r'^kvcached_prefix_query_tokens_total\{model="m"\} (\S+)',
                                   text, re.M).group(1)))  # fmt: skip
    return out


def gauge(url: str, pattern: str) -> float | None:
    m = re.search(pattern, httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else None


def test_smg_cache_aware_keeps_each_prefix_on_one_replica(replicas):
    workers, _ = replicas
    prom = free_port()
    router = smg("cache_aware", workers, metrics_port=prom)
    try:
        router.first_answer(timeout=120, prompt="hi")
        reset(workers)
        h0, q0 = counters(workers)
        ask(router, 8)
        h1, q1 = counters(workers)
        # Two families: each misses once, then every request finds its head cached on
        # the replica the router keeps it on.
        head_blocks = [len(httpx.post(workers[0].url + "/tokenize", json={
            "model": "m", "prompt": h}).json()["tokens"]) // 16 for h in HEADS]  # fmt: skip
        assert h1 - h0 >= 16 * 3 * sum(head_blocks), (h1 - h0, q1 - q0)
        # The gateway's model list and load figures come from the replicas.
        models = httpx.get(router.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["m"]
        # Its load monitor reads the figures we publish under vLLM's names.
        rates = []
        for w in workers:
            ours = gauge(w.url, r'^vllm:gpu_prefix_cache_hit_rate\{model_name="m"\} (\S+)')
            rates.append(ours)
            want = rf'^smg_engine_cache_hit_rate\{{worker="{w.url}",model="m"[^}}]*\}} (\S+)'
            deadline = time.monotonic() + 60
            smg_url = f"http://127.0.0.1:{prom}"
            while (got := gauge(smg_url, want)) is None or abs(got - ours) > 1e-9:
                assert time.monotonic() < deadline, (w.url, ours)  # (a hang guard)
                time.sleep(0.5)
        assert max(rates) > 0
        assert gauge(workers[0].url, r'^vllm:num_requests_running\{model_name="m"\} (\S+)') == 0
    finally:
        router.stop()


def test_vllm_router_kv_aware_routes_by_our_kv_events(replicas):
    workers, events = replicas
    prom = free_port()
    router = vllm_router(workers, events, metrics_port=prom)
    try:
        router.first_answer(timeout=120, prompt="hi")
        reset(workers)
        before = served_by(workers)
        ask(router, 6)
        text = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "hit" not in text:
            text = httpx.get(f"http://127.0.0.1:{prom}/metrics", timeout=10).text
            text = "\n".join(x for x in text.splitlines()
                             if x.startswith("vllm_router_kv_placement_lookups_total"))
            time.sleep(0.2)
        hits = re.search(r'result="hit"\} (\S+)', text)
        # The router found the families' blocks in the index it built from our events.
        assert hits and float(hits.group(1)) >= 4, text
        after = served_by(workers)
        assert sum(a - b for a, b in zip(after, before, strict=True)) > 0
    finally:
        router.stop()
