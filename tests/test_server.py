"""The real OpenAI-compatible server on loopback: concurrent clients, streaming,
overload, bad input, limit changes while serving, metrics and `top`."""

import json
import threading
import time

import httpx
import pytest

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, ByteTokenizer, build_model
from jax_kvcached.serve.app import AuthConfig, BackgroundServer, ServedModel, create_app
from jax_kvcached.serve.loop import ServingLoop
from jax_kvcached.serve.top import render, scrape, size

PAGE = 16384
SEEDS = {"llama": ("tiny-llama", 1), "qwen": ("tiny-qwen2", 2)}
PROMPTS = ["The quick brown fox", "Virtual memory lets a KV cache", "def f(n):", "JAX is"]


def make_engines(pool, max_batch=4):
    return {
        name: Engine(
            build_model(BUILTIN_CONFIGS[preset], seed=seed),
            pool,
            name=name,
            max_batch=max_batch,
            tokenizer=ByteTokenizer(),
        )  # fmt: skip
        for name, (preset, seed) in SEEDS.items()
    }


def make_pool(pages=96):
    return kv.Pool(
        pages * PAGE, page_size=PAGE, backend="host", min_reserved_pages=0, max_reserved_pages=0
    )


class Server:
    def __init__(self, max_batch=4, max_queue=64, pages=96, auth=None, allowed_hosts=None):
        self.pool = make_pool(pages)
        self.engines = make_engines(self.pool, max_batch)
        self.loop = ServingLoop(self.engines, max_queue=max_queue).start()
        self.app_models = {n: ServedModel(e, ByteTokenizer()) for n, e in self.engines.items()}
        auth = auth or AuthConfig(allow_unauthenticated_admin=True)
        app = create_app(self.loop, self.app_models, auth=auth, allowed_hosts=allowed_hosts)
        self.http = BackgroundServer(app).start()
        self.url = self.http.url

    def close(self):
        self.http.stop()
        self.loop.stop()
        self.pool.close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def alone(name, prompts, max_tokens):
    pool = make_pool(256)
    eng = make_engines(pool)[name]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = [o.text for o in eng.generate(prompts, params)]
    pool.close()
    return out


def complete(url, model, prompt, max_tokens=8, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(url, path, body):
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]


def stream_text(url, model, prompt, max_tokens=8):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    events = sse_events(url, "/v1/completions", body)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(e["choices"][0]["text"] for e in events)


def test_health_and_models(server):
    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200 and h.json()["models"] == {"llama": "ok", "qwen": "ok"}
    m = httpx.get(f"{server.url}/v1/models").json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["llama", "qwen"]
    one = httpx.get(f"{server.url}/v1/models/qwen")  # the SDK's models.retrieve
    assert one.status_code == 200 and one.json() == m["data"][1]
    r = httpx.get(f"{server.url}/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_concurrent_clients_streaming_and_not_match_each_engine_alone(server):
    results = {}

    def client(model, i, streaming):
        p = PROMPTS[i]
        if streaming:
            results[model, i] = stream_text(server.url, model, p, 12)
        else:
            r = complete(server.url, model, p, 12)
            assert r["object"] == "text_completion" and r["model"] == model
            assert r["usage"]["completion_tokens"] == 12
            assert r["usage"]["prompt_tokens"] == len(p) + 1  # bytes + BOS
            results[model, i] = r["choices"][0]["text"]

    threads = [
        threading.Thread(target=client, args=(m, i, i % 2 == 0))
        for m in SEEDS
        for i in range(len(PROMPTS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in SEEDS:
        assert [results[m, i] for i in range(len(PROMPTS))] == alone(m, PROMPTS, 12)
    # every request finished: only the prefix caches still hold blocks
    for e in server.engines.values():
        assert e.cache.num_used_blocks == e.prefix_cache.num_cached_blocks


def test_an_unseeded_sampled_request_reports_a_seed_that_replays_it(server):
    first = complete(server.url, "llama", "seed me", 16, temperature=1.0, seed=None)
    again = complete(server.url, "llama", "seed me", 16, temperature=1.0)
    assert isinstance(first["seed"], int) and first["seed"] != again["seed"]
    replay = complete(server.url, "llama", "seed me", 16, temperature=1.0, seed=first["seed"])
    assert replay["seed"] == first["seed"]
    assert replay["choices"][0]["text"] == first["choices"][0]["text"]
    events = sse_events(
        server.url, "/v1/completions",
        {"model": "llama", "prompt": "seed me", "max_tokens": 16, "temperature": 1.0,
         "ignore_eos": True, "stream": True, "seed": first["seed"]},
    )  # fmt: skip
    assert {e["seed"] for e in events} == {first["seed"]}
    assert "".join(e["choices"][0]["text"] for e in events) == first["choices"][0]["text"]


def test_chat_completion_streaming_and_not(server):
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and out["usage"]["completion_tokens"] == 6
    events = sse_events(
        server.url, "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["choices"] == []
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == msg["content"]
    # vLLM's continuous_usage_stats (guidellm sends it): running usage in every chunk
    events = sse_events(
        server.url, "/v1/chat/completions",
        {**body, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )  # fmt: skip
    done = [e["usage"]["completion_tokens"] for e in events if e["choices"]
            and "content" in e["choices"][0]["delta"] and e["choices"][0]["delta"]["content"]]
    assert done == sorted(done) and done[-1] == 6 and len(done) >= 2
    assert all("usage" in e for e in events[1:])  # (the role chunk precedes any token)


def test_stop_string_ends_the_request(server):
    full = complete(server.url, "llama", "Hello", 16)["choices"][0]["text"]
    stop = full[4:6]
    cut = full[: full.find(stop)]
    r = complete(server.url, "llama", "Hello", 16, stop=[stop])
    assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"


def test_vllm_request_extensions(server):
    full = complete(server.url, "llama", "Hello", 16)["choices"][0]["text"]
    stop = full[4:6]
    # include_stop_str_in_output: the text runs to the end of the stop string
    r = complete(server.url, "llama", "Hello", 16, stop=[stop], include_stop_str_in_output=True)
    assert r["choices"][0]["text"] == full[: full.find(stop) + len(stop)]
    # request_id names the response; priority 0 and the default detokenization accepted
    r = complete(server.url, "llama", "Hello", 4, request_id="abc-1", priority=0,
                 skip_special_tokens=True, spaces_between_special_tokens=True)  # fmt: skip
    assert r["id"] == "cmpl-abc-1"
    # truncate_prompt_tokens keeps the prompt's last k tokens; add_special_tokens: no BOS
    ids = list(range(40, 60))
    a = complete(server.url, "llama", ids, 6, temperature=0, truncate_prompt_tokens=5)
    b = complete(server.url, "llama", ids[-5:], 6, temperature=0)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["prompt_tokens"] == 5
    with_bos = complete(server.url, "llama", "Hi", 1)["usage"]["prompt_tokens"]
    without = complete(server.url, "llama", "Hi", 1, add_special_tokens=False)
    assert without["usage"]["prompt_tokens"] == with_bos - 1
    # chat: continue_final_message goes on with the assistant's text
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}]
    body = {"model": "llama", "messages": msgs, "max_tokens": 3, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < httpx.post(
        f"{server.url}/v1/chat/completions", timeout=120,
        json={**body, "continue_final_message": False}).json()["usage"]["prompt_tokens"]
    for extra, param in (({"priority": 1}, "priority"), ({"priority": False}, "priority"),
                         ({"skip_special_tokens": False}, "skip_special_tokens"),
                         ({"skip_special_tokens": 1}, "skip_special_tokens"),
                         ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"request_id": ""}, "request_id")):  # fmt: skip
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "llama", "prompt": "x", **extra})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={**body, "add_generation_prompt": True})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ({"model": "llama", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"model": "llama", "prompt": "x", "n": 0}, 400, "n"),
        ({"model": "llama", "prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
        ({"model": "llama", "prompt": ""}, 400, "prompt"),
        ({"model": "llama", "prompt": [1, "a"]}, 400, "prompt"),
        ({"model": "llama", "prompt": [100000]}, 400, "prompt"),
        ({"model": "llama", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "llama", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": "llama", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "x"}, 400, "model"),
        ([1, 2], 400, None),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    kw = ({"content": body, "headers": {"Content-Type": "application/json"}}
          if isinstance(body, bytes) else {"json": body})  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] in ("invalid_request_error",)
    assert err["param"] == param


def test_bad_chat_and_routes(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "qwen", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    bad = {"model": "qwen", "messages": [{"role": "robot", "content": "x"}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=bad).status_code == 400
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405


def test_metrics_and_top(server):
    complete(server.url, "qwen", "metrics", 4)
    m = scrape(server.url)
    by_model = {dict(k)["model"]: v for k, v in m["kvcached_mapped_bytes"].items()}
    assert set(by_model) == {"llama", "qwen"}
    assert by_model["qwen"] == server.engines["qwen"].stats()["mapped_bytes"]
    count = {dict(k)["model"]: v for k, v in m["kvcached_ttft_seconds_count"].items()}
    ok = {
        dict(k)["model"]: v
        for k, v in m["kvcached_requests_total"].items()
        if dict(k)["outcome"] == "ok"
    }
    assert count["qwen"] == ok["qwen"] >= 1
    for name in ("kvcached_prefix_hit_rate", "kvcached_queue_depth", "kvcached_pool_budget_bytes"):
        assert name in m
    frame = render(m)
    assert "llama" in frame and "qwen" in frame and "pool [" in frame
    row = next(ln for ln in frame.splitlines() if ln.startswith("qwen"))
    assert row.split()[1] == size(by_model["qwen"]) and row.split()[1].endswith("iB")
    assert all(len(ln) <= 80 for ln in frame.splitlines())  # a classic terminal
    # long names, big sizes, a failed model: still 80 columns
    big = {
        k: {((("model", "a-very-long-model-name-indeed"),)): 123.4 * 2**30}
        for k in ("kvcached_mapped_bytes", "kvcached_memory_limit_bytes", "kvcached_model_failed")
    }
    assert all(len(ln) <= 80 for ln in render({**m, **big}).splitlines())
    assert (size(512 * 1024), size(3 * 2**20), size(1.25 * 2**30), size(None)) == (
        "512KiB",
        "3.0MiB",
        "1.2GiB",
        "-",
    )


def test_limit_change_while_serving(server):
    name = "llama"
    prompts = [f"limit test {i}: " + "x" * 60 for i in range(4)]
    want = alone(name, prompts, 24)
    got = {}

    def client(i):
        got[i] = stream_text(server.url, name, prompts[i], 24)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    r = httpx.post(f"{server.url}/admin/memory", json={"model": name, "limit": 16 * PAGE})
    assert r.status_code == 200
    assert r.json()["models"][name]["limit_bytes"] == 16 * PAGE
    for t in threads:
        t.join()
    assert [got[i] for i in range(4)] == want
    eng = server.engines[name]
    assert eng.cache.num_mapped_pages * eng.cache.pages_per_kv_page <= 16
    bad = httpx.post(f"{server.url}/admin/memory", json={"model": name, "limit": "lots"})
    assert bad.status_code == 400
    assert httpx.post(f"{server.url}/admin/memory", json={"model": "zz"}).status_code == 404
    r = httpx.post(f"{server.url}/admin/memory", json={"model": name, "limit": None})
    assert r.json()["models"][name]["limit_bytes"] is None


def wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_client_going_away_frees_its_request(server):
    eng = server.engines["qwen"]
    before = server.loop.stats()["qwen"]
    body = {"model": "qwen", "prompt": "bye", "max_tokens": 900, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60):
        wait_for(
            lambda: server.loop.stats()["qwen"]["generated_tokens"] > before["generated_tokens"]
        )
    wait_for(lambda: server.loop.stats()["qwen"]["outstanding"] == 0 and not eng.has_work)
    after = server.loop.stats()["qwen"]
    assert after["finished"] == before["finished"]  # cancelled, not run to the end
    assert after["generated_tokens"] - before["generated_tokens"] < 900


def test_overload_answers_429_and_a_stopped_loop_503():
    s = Server(max_batch=1, max_queue=0)
    try:
        body = {"model": "llama", "prompt": "long", "max_tokens": 600, "ignore_eos": True}
        long = threading.Thread(
            target=lambda: httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
        )
        long.start()
        wait_for(lambda: s.loop.stats()["llama"]["running"] == 1)
        busy = httpx.post(f"{s.url}/v1/completions", json={"model": "llama", "prompt": "x"})
        assert busy.status_code == 429
        assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        other = httpx.post(
            f"{s.url}/v1/completions", json={"model": "qwen", "prompt": "x"}, timeout=120
        )
        assert other.status_code == 200  # the other model's queue is its own
        long.join()
        s.loop.stop()
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "qwen", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert httpx.get(f"{s.url}/health").status_code == 503
    finally:
        s.close()


def test_one_server_over_engines_of_several_pools():
    """A loop may span pools (one per device): metrics, admin and top see every pool, and
    a limit set through the admin route lands in the model's own pool."""
    pools = {"llama": make_pool(64), "qwen": make_pool(32)}
    engines = {
        name: Engine(
            build_model(BUILTIN_CONFIGS[preset], seed=seed),
            pools[name],
            name=name,
            max_batch=2,
            tokenizer=ByteTokenizer(),
        )  # fmt: skip
        for name, (preset, seed) in SEEDS.items()
    }
    loop = ServingLoop(engines).start()
    models = {n: ServedModel(e, ByteTokenizer()) for n, e in engines.items()}
    app = create_app(loop, models, auth=AuthConfig(allow_unauthenticated_admin=True))
    try:
        with BackgroundServer(app) as http:
            for name in engines:
                body = {"model": name, "prompt": "JAX is", "max_tokens": 4}
                r = httpx.post(f"{http.url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
            mem = httpx.get(f"{http.url}/admin/memory").json()
            assert mem["budget_bytes"] == (64 + 32) * PAGE
            assert sorted(p["models"] for p in mem["pools"]) == [["llama"], ["qwen"]]
            r = httpx.post(f"{http.url}/admin/memory", json={"model": "qwen", "limit": 8 * PAGE})
            assert r.status_code == 200, r.text
            assert pools["qwen"].memory_limit_of("qwen").limit_bytes == 6 * PAGE  # 3 layers
            m = scrape(http.url)
            budgets = m["kvcached_pool_budget_bytes"]
            assert sorted(budgets.values()) == [32 * PAGE, 64 * PAGE]
            assert "pool [" in render(m) and size(96 * PAGE) in render(m)
    finally:
        loop.stop()
        for p in pools.values():
            p.close()


def test_warm_up_traffic_is_not_served_traffic():
    """After the warm-up compile, /metrics reads as a fresh server: no steps, tokens,
    requests, TTFT samples or prefix lookups, and nothing left mapped."""
    from jax_kvcached.serve.launch import warm_up

    pool = make_pool(64)
    eng = Engine(build_model(BUILTIN_CONFIGS["tiny-llama"], seed=1), pool, name="w",
                 max_batch=2, max_model_len=64, tokenizer=ByteTokenizer())  # fmt: skip
    served = ServedModel(eng, ByteTokenizer())
    assert warm_up(served, "w") > 0 and eng.runner.warm
    loop = ServingLoop({"w": eng}).start()
    http = BackgroundServer(create_app(loop, {"w": served})).start()
    try:
        m = scrape(http.url)

        def one(name):
            return sum(v for k, v in m.get(name, {}).items() if dict(k).get("model") == "w")

        for name in ("kvcached_steps_total", "kvcached_generated_tokens_total",
                     "kvcached_prefix_query_tokens_total", "kvcached_ttft_seconds_count",
                     "kvcached_requests_total", "kvcached_mapped_bytes"):  # fmt: skip
            assert one(name) == 0, name
        complete(http.url, "w", "x", 2)
        assert sum(scrape(http.url)["kvcached_steps_total"].values()) > 0  # counted from here
    finally:
        http.stop()
        loop.stop()
        pool.close()
