"""No request can take a model down: bad input, auth, bounded bodies, disconnects,
graceful shutdown, incremental detokenization and the low-level API's misuse cases."""

import json
import math
import signal
import socket
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FFI_ERRORS, make_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import start_serve
from test_engine import assert_only_cached_blocks_hold_pages
from test_server import Server, wait_for

import jax_kvcached as kv
from jax_kvcached.engine.detokenizer import TextStream
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory import ops
from jax_kvcached.models import ByteTokenizer
from jax_kvcached.serve.app import AuthConfig

API, ADMIN = "sk-test-api", "sk-test-admin"
H = {"Authorization": f"Bearer {API}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    s = Server(auth=AuthConfig(api_key=API, admin_key=ADMIN))
    yield s
    s.close()


def post(url, body, path="/v1/completions", headers=H, **kw):
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120, **kw)


def assert_openai_error(r, status=None):
    assert 400 <= r.status_code < 500 if status is None else r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def assert_in_service(s):
    for model in ("llama", "qwen"):
        r = post(s.url, {"model": model, "prompt": "ok", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    health = httpx.get(f"{s.url}/health", headers=H).json()
    assert health["status"] == "ok" and health["models"] == {"llama": "ok", "qwen": "ok"}


def assert_no_leak(s):
    wait_for(lambda: all(v["outstanding"] == 0 for v in s.loop.stats().values()))
    for eng in s.engines.values():
        wait_for(lambda eng=eng: not eng.has_work)
        c, pc = eng.cache, eng.prefix_cache
        assert c.num_used_blocks == pc.num_cached_blocks
        pages = {c.page_of(b) for b in pc.cached_blocks()}
        assert set(c.mapped_page_ids()) == pages


# -- per-request errors never fail the model ---------------------------------------------
def test_huge_top_k_is_a_400_or_clipped_and_the_model_stays_in_service(server):
    for top_k in (1 << 40, 1 << 31, 10**40):
        r = post(server.url, {"model": "llama", "prompt": "x", "top_k": top_k, "max_tokens": 2})
        assert_openai_error(r, 400)
    # Within int32 but above the vocabulary: clipped (keeps every token), runs.
    r = post(server.url, {"model": "llama", "prompt": "x", "top_k": (1 << 31) - 1,
                          "max_tokens": 2, "temperature": 0.7})  # fmt: skip
    assert r.status_code == 200, r.text
    for field, value in (("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("max_tokens", 1 << 40),
                         ("temperature", 1e308), ("top_p", 0)):  # fmt: skip
        r = post(server.url, {"model": "qwen", "prompt": "x", field: value})
        assert_openai_error(r, 400)
    assert_in_service(server)


def test_sampling_params_reject_what_does_not_fit_the_step_inputs():
    for kw in ({"top_k": 1 << 31}, {"seed": -1}, {"seed": 1 << 32}, {"max_tokens": 1 << 31},
               {"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan},
               {"stop_token_ids": (-1,)}):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    for kw in ({"top_k": 1.5}, {"seed": "1"}, {"max_tokens": True}):
        with pytest.raises(TypeError):
            SamplingParams(**kw)
    SamplingParams(top_k=(1 << 31) - 1, seed=(1 << 32) - 1)  # the edges fit


def test_context_length_exceeded_has_its_code(server):
    r = post(server.url, {"model": "llama", "prompt": "x" * 5000})
    assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"
    r = post(server.url, {"model": "llama", "prompt": "x" * 100, "max_tokens": 1000})
    assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"


def test_nested_and_non_standard_json_is_a_400(server):
    for raw in (b"[" * 100000, b'{"a":' * 50000, b'{"model": NaN}', b"\xff\xfe", b"1" * 5000):
        r = httpx.post(f"{server.url}/v1/completions", content=raw, headers=H, timeout=60)
        assert_openai_error(r, 400)


# -- bodies are bounded while they stream in ---------------------------------------------
def _raw_request(url, head: bytes, chunks=()):
    """Sends a request head and body chunks on a socket; returns the status line and
    whether the server answered before the body was complete."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        answered_early = False
        for c in chunks:
            try:
                sock.sendall(c)
            except OSError:  # the server closed the connection: it answered already
                answered_early = True
                break
        sock.settimeout(30)
        data = sock.recv(65536)
    return data.split(b"\r\n", 1)[0].decode(), answered_early or bool(data)


def test_body_limit_is_enforced_before_the_body_is_read(server):
    auth = f"Authorization: Bearer {API}\r\n".encode()
    # A declared 400 MB body: refused from the header, nothing of it sent.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + auth + b"Content-Length: 400000000\r\n\r\n")  # fmt: skip
    status, _ = _raw_request(server.url, head)
    assert status.split()[1] == "413"
    # Chunked: refused once past 1 MiB, the terminating chunk never sent.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + auth + b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    piece = b"x" * (256 << 10)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    status, early = _raw_request(server.url, head, [chunk] * 5)
    assert status.split()[1] == "413" and early
    assert_in_service(server)


# -- auth ------------------------------------------------------------------------------
def test_auth_on_every_route(server):
    u = server.url
    gen = {"model": "llama", "prompt": "hi", "max_tokens": 1}
    chat = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    routes = [("GET", "/v1/models", None), ("POST", "/v1/completions", gen),
              ("POST", "/v1/chat/completions", chat)]  # fmt: skip
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API},
                        {"Authorization": f"Bearer {ADMIN}"}):  # fmt: skip
            r = httpx.request(method, f"{u}{path}", json=body, headers=headers, timeout=60)
            assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.request(method, f"{u}{path}", json=body, headers=H, timeout=60)
        assert r.status_code == 200, (path, r.text)
    for method in ("GET", "POST"):
        body = {"model": "llama", "limit": None} if method == "POST" else None
        for headers in ({}, H):  # the API key is not the admin key
            r = httpx.request(method, f"{u}/admin/memory", json=body, headers=headers)
            assert_openai_error(r, 401)
        r = httpx.request(method, f"{u}/admin/memory", json=body,
                          headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert r.status_code == 200 and "models" in r.json()
    # /health answers its status to anyone, names the models only to a caller with a key;
    # /metrics (tenants, PIDs, prefix-hit counters) needs the API key or the admin key
    open_health = httpx.get(f"{u}/health")
    assert open_health.status_code == 200 and open_health.json() == {"status": "ok"}
    assert "models" in httpx.get(f"{u}/health", headers=H).json()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert_openai_error(httpx.get(f"{u}/metrics", headers=headers), 401)
    for headers in (H, {"Authorization": f"Bearer {ADMIN}"}):
        r = httpx.get(f"{u}/metrics", headers=headers)
        assert r.status_code == 200 and "kvcached_prefix_cached_tokens" in r.text


def test_admin_routes_are_disabled_without_an_admin_key():
    s = Server(auth=AuthConfig(api_key=API))
    try:
        r = httpx.post(f"{s.url}/admin/memory", json={"model": "llama", "limit": 0}, headers=H)
        assert assert_openai_error(r, 403)["code"] == "admin_disabled"
        assert s.pool.memory_limits()["llama"].limit_bytes is None  # nothing changed
        assert httpx.get(f"{s.url}/v1/models", headers=H).status_code == 200
    finally:
        s.close()


# -- abandoned requests are cancelled ----------------------------------------------------
def test_non_streaming_disconnect_frees_the_slot(server):
    eng = server.engines["qwen"]
    before = server.loop.stats()["qwen"]
    body = json.dumps({"model": "qwen", "prompt": "bye", "max_tokens": 900, "ignore_eos": True})
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API}\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode())
    wait_for(lambda: server.loop.stats()["qwen"]["generated_tokens"] > before["generated_tokens"])
    sock.close()  # the client goes away without reading
    wait_for(lambda: server.loop.stats()["qwen"]["outstanding"] == 0 and not eng.has_work)
    after = server.loop.stats()["qwen"]
    assert after["finished"] == before["finished"]  # cancelled, not run to the end
    assert after["generated_tokens"] - before["generated_tokens"] < 900
    assert_no_leak(server)


# -- fuzz: randomized bad bodies ---------------------------------------------------------
_junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=8,
)  # fmt: skip
_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed",
           "stop", "stream", "stream_options", "n", "user", "logprobs", "ignore_eos",
           "cache_salt", "max_completion_tokens", "echo", "unknown_field", "best_of",
           "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "logit_bias", "min_tokens", "stop_token_ids", "suffix"]  # fmt: skip


@st.composite
def _bad_body(draw):
    chat = draw(st.booleans())
    body = {"model": draw(st.sampled_from(["llama", "qwen"])), "max_tokens": 2}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    for key in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3, unique=True)):
        body[key] = draw(_junk)
    return chat, body


def test_fuzzed_bodies_get_4xx_and_never_fail_a_model(server):
    seen = {"4xx": 0, "ok": 0}

    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(_bad_body())
    def check(case):
        chat, body = case
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            raw = json.dumps(body).encode()
        except ValueError:
            return
        r = httpx.post(f"{server.url}{path}", content=raw, headers=H, timeout=120)
        if r.status_code == 200:  # some mutations are valid requests
            seen["ok"] += 1
            text = r.text
            assert "data: [DONE]" in text if body.get("stream") is True else "choices" in r.json()
            return
        assert_openai_error(r)
        seen["4xx"] += 1

    check()
    assert seen["4xx"] >= 60, seen
    assert_in_service(server)
    assert_no_leak(server)


# -- incremental detokenization ----------------------------------------------------------
class CountingDecode:
    def __init__(self):
        self.tokens = 0
        self.tok = ByteTokenizer()

    def __call__(self, ids):
        self.tokens += len(ids)
        return self.tok.decode(ids)


def test_text_stream_decodes_a_bounded_window_per_token():
    for n in (500, 4000):
        dec = CountingDecode()
        s = TextStream(dec, ["never-there"])
        text = "héllo wörld, " * (n // 13 + 1)
        ids = list(text.encode())[:n]
        out = "".join(s.feed(t) for t in ids) + s.flush()
        assert out == bytes(ids).decode("utf-8", errors="replace")
        assert dec.tokens <= 8 * n  # linear in the output, not quadratic


def test_text_stream_bounds_the_hold_back_of_invalid_bytes():
    s = TextStream(ByteTokenizer().decode, [])
    deltas = [s.feed(0xFF) for _ in range(50)]
    released = "".join(deltas)
    assert released.count("\ufffd") >= 40  # not all held to the end
    assert max(i for i, d in enumerate(deltas) if d) >= 40
    assert (released + s.feed(ord("a")) + s.flush()).endswith("a")
    s = TextStream(ByteTokenizer().decode, [])  # a split multi-byte char is still joined
    assert [s.feed(b) for b in "é".encode()] == ["", "é"]


# -- low-level misuse --------------------------------------------------------------------
def test_closed_pool_refuses_new_caches_and_allocations():
    pool = kv.Pool("16MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    c = make_cache(pool)
    pool.close()
    assert pool.closed
    with pytest.raises(kv.KVCacheError, match="closed"):
        make_cache(pool, name="b")
    with pytest.raises(kv.KVCacheError, match="closed"):
        c.alloc(1)
    assert pool.stats()["mapped_pages"] == 0


def test_free_rejects_non_integer_block_ids(pool):
    c = make_cache(pool)
    ids = c.alloc(3)
    for bad in ([1.7], np.array([1.0]), [True], ["1"]):
        with pytest.raises(TypeError, match="integer block ids"):
            c.free(bad)
    assert all(c.is_allocated(b) for b in ids)  # nothing was freed
    c.free(ids)
    c.free([])  # an empty list is fine
    assert pool.stats()["mapped_pages"] == 0


def test_unmap_op_refuses_pages_the_allocator_owns(pool):
    c = make_cache(pool)
    ids = c.alloc(2)
    page = int(ids[0]) // c.blocks_per_page
    with pytest.raises(FFI_ERRORS, match="block allocator"):
        ops.unmap_pages(c, jnp.array([page], jnp.int32), ops.new_token()).block_until_ready()
    assert c.is_page_mapped(page)  # the allocator's state is intact
    c.free(ids)
    assert pool.stats()["mapped_pages"] == 0
    # The op's own pages: mapped and unmapped by the ops; the allocator cannot unmap them.
    own = c.num_pages - 1
    ops.map_pages(c, jnp.array([own], jnp.int32), ops.new_token()).block_until_ready()
    with pytest.raises(kv.KVCacheError, match="map_pages op"):
        c.buffer.unmap_pages(np.array([own], np.int32))
    ops.unmap_pages(c, jnp.array([own], jnp.int32), ops.new_token()).block_until_ready()
    assert pool.stats()["mapped_pages"] == 0


def test_engine_survives_bad_params_and_clips_top_k():
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    from test_server import make_engines

    eng = make_engines(pool)["llama"]
    with pytest.raises(TypeError):
        eng.add_request([1, 2], {"top_k": 5})
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, top_k=10**6, temperature=1.0))
    assert len(out[0].token_ids) == 3
    assert_only_cached_blocks_hold_pages(eng, pool)
    pool.close()


# -- graceful shutdown -------------------------------------------------------------------
def test_sigterm_finishes_within_the_deadline_and_cancels_the_rest(tmp_path):
    """One request runs at a time (--max-batch 1) and far more work is queued than the
    deadline allows (a tiny model decodes ~3000 tokens/s here): the three streams are still
    queued or running at the deadline and end with the shutdown error event."""
    deadline_s = 1.5
    key_file = tmp_path / "key"
    key_file.write_text(API + "\n")
    proc, url = start_serve(
        ["--model", "a=tiny-llama", "--memory", "32MiB", "--page-size", "256KiB",
         "--no-warmup", "--backend", "host", "--api-key-file", str(key_file),
         "--shutdown-timeout", str(deadline_s), "--max-batch", "1"],
        tmp_path,
    )  # fmt: skip
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key file is used
        body = {"model": "a", "prompt": "hi", "max_tokens": 1000, "ignore_eos": True,
                "temperature": 0}  # fmt: skip
        # Compile every shape the measured run will use first (a compile in progress
        # cannot be interrupted, so it would delay the cancel past the deadline).
        post(url, {**body, "max_tokens": 4})

        def filler():
            try:
                post(url, body)
            except httpx.HTTPError:  # the server went away mid-request: expected here
                pass

        fillers = [threading.Thread(target=filler) for _ in range(24)]
        for t in fillers:
            t.start()
        results: dict[int, list[str]] = {}

        def client(i):
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                              headers=H, timeout=120) as r:  # fmt: skip
                results[i] = [ln for ln in r.iter_lines() if ln]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # serving
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        for t in threads + fillers:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "shutting down: in-flight requests get 1.5 s" in out, out
    # Cancelled at the deadline, not let finish: each stream ends with the shutdown error
    # event before its 1000 tokens (the queued work, 27 requests of 1000 tokens one at a
    # time, would take seconds more; `communicate`'s 60 s is a hang guard, not the check).
    assert len(results) == 3
    for lines in results.values():
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: ") :])
        message = last.get("error", {}).get("message", "")
        assert "shutting down" in message, lines[-4:]  # cancelled with an error event
        tokens = [ln for ln in lines[:-2] if '"text"' in ln]
        assert len(tokens) < 1000, len(tokens)


def test_a_request_that_can_never_fit_is_a_400_naming_why(server):
    """64 prompts x n=16 is more engine requests than the model runs and queues at once:
    a retry can never succeed, so it is a 400 (not a 429) naming the field, and nothing
    is submitted; the model stays in service."""
    before = server.loop.stats()["llama"]["finished"]
    r = post(server.url, {"model": "llama", "prompt": ["hi"] * 64, "n": 16, "max_tokens": 2})
    err = assert_openai_error(r, 400)
    assert err["code"] == "request_too_large" and err["param"] == "n"
    assert "64 prompts x 16 samples" in err["message"] and "max_queue" in err["message"]
    r = post(server.url, {"model": "llama", "prompt": ["hi"] * 64, "n": 2, "best_of": 16,
                          "max_tokens": 2})  # fmt: skip
    assert assert_openai_error(r, 400)["param"] == "best_of"
    assert server.loop.stats()["llama"]["finished"] == before  # nothing ran
    assert_no_leak(server)
    assert_in_service(server)
