"""Strangers at the server's boundaries (docs/security.md), each refused with the server
still serving: a browser page's cross-site POST, a foreign Origin or Host (DNS
rebinding), a prompt cached under another user's ``cache_salt``, empty keys, admin routes
open beyond loopback, a compile cache another user could have filled, a crash's details.
(The step channel between hosts: tests/test_step_channel.py.)"""

from __future__ import annotations

import logging
import os

import httpx
import pytest
from test_server import Server

from jax_kvcached.engine.config import ConfigError
from jax_kvcached.serve.compile_cache import enable_compile_cache, untrusted
from jax_kvcached.serve.config import ServeConfig

PROMPT = "The secret plan of the first user, long enough for several full blocks" * 2


def complete(server: Server, **extra) -> httpx.Response:
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def assert_serving(server: Server) -> None:
    r = complete(server, max_tokens=1)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def server():
    s = Server(pages=512, allowed_hosts=["localhost", "127.0.0.1", "::1"])
    yield s
    s.close()


def test_a_browser_pages_cross_site_requests_are_refused(server):
    # a text/plain POST (a "simple" request: no preflight) to an admin and an API route
    for path, body in (("/admin/sleep", '{"model": "llama"}'), ("/v1/completions", "{}")):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "text/plain"})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    # a foreign Origin (CORS is off), and a rebinding DNS name in the Host header
    r = httpx.post(server.url + "/admin/sleep", json={"model": "llama"},
                   headers={"Origin": "http://evil.example"})  # fmt: skip
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/models", headers={"Host": "evil.example:8000"})
    assert r.status_code == 400 and "Host header" in r.json()["error"]["message"]
    # the loopback names pass, with or without a port
    for host in ("localhost", f"127.0.0.1:{server.http.port}", "[::1]:80"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200
    assert_serving(server)


def test_a_salted_prompt_is_missed_by_an_unsalted_request(server):
    cached, prompt = [], "Alice's own words, which nobody else has sent yet: " + PROMPT
    for salt in ("alice", None, "bob", "alice"):
        r = complete(server, prompt=prompt, **({"cache_salt": salt} if salt else {}))
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # only alice's second request finds alice's blocks (the check can fail: it does hit)
    assert cached[:3] == [0, 0, 0] and cached[3] >= 16 * (len(prompt) // 16 - 1), cached
    # exact accounting, every request done (the loop idle): only cached blocks hold pages
    c, pc = server.engines["llama"].cache, server.engines["llama"].prefix_cache
    assert c.num_used_blocks == pc.num_cached_blocks == pc.num_evictable_blocks
    assert set(c.mapped_page_ids()) == {c.page_of(b) for b in pc.cached_blocks()}
    assert_serving(server)


def test_each_tenant_keeps_its_cached_prefixes(server, tmp_path):
    from jax_kvcached.serve.app import BackgroundServer, create_app

    keys = tmp_path / "tenants"
    keys.write_text("# tenant key\nalice a-key-1\nalice a-key-2  # her second key\n"
                    "bob b-key\n")  # fmt: skip
    auth = ServeConfig(api_key="default-key", tenant_keys_file=str(keys)).auth()
    app = create_app(server.loop, server.app_models, auth=auth)  # (the same engines)
    http = BackgroundServer(app).start()
    try:
        prompt = "Tenants' words, which nobody has sent to this cache yet: " + PROMPT

        def cached(key, **extra):
            r = httpx.post(http.url + "/v1/completions", timeout=120,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "llama", "prompt": prompt, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        full = 16 * (len(prompt) // 16 - 1)
        assert cached("a-key-1") == 0
        assert cached("a-key-2") >= full  # the same tenant shares (the check can fail)
        assert cached("b-key") == 0 and cached("default-key") == 0
        assert cached("b-key") >= full  # bob's own second request hits
        assert cached("a-key-1", cache_salt="x") == 0  # a salt splits within a tenant
        # no request salt can name a tenant's (NUL is refused), no key is no tenant
        r = httpx.post(http.url + "/v1/completions", json={
            "model": "llama", "prompt": prompt, "cache_salt": "\x00tenant\x00alice\x00"},
            headers={"Authorization": "Bearer default-key"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        r = httpx.post(http.url + "/v1/completions", json={"model": "llama", "prompt": "x"})
        assert r.status_code == 401
        # every tenant's counters are the operator's: a tenant's key gets a 403
        def metrics(key):
            return httpx.get(http.url + "/metrics", headers={"Authorization": f"Bearer {key}"})

        assert metrics("b-key").status_code == 403 and metrics("nokey").status_code == 401
        assert metrics("default-key").status_code == 200
    finally:
        http.stop()
    c, pc = server.engines["llama"].cache, server.engines["llama"].prefix_cache
    assert set(c.mapped_page_ids()) == {c.page_of(b) for b in pc.cached_blocks()}
    # bad files name the line; a key is one tenant's
    for text, why in (("alice\n", ":1: not 'TENANT KEY'"), ("a k\nb k\n", ":2: a key given"),
                      ("al/ice k\n", ":1: not"), ("# none\n", "no 'TENANT KEY'")):
        keys.write_text(text)
        with pytest.raises(ConfigError, match=why):
            ServeConfig(tenant_keys_file=str(keys)).auth()
    keys.write_text("alice same\n")
    with pytest.raises(ConfigError, match="holds the --api-key too"):
        ServeConfig(api_key="same", tenant_keys_file=str(keys)).auth()


def test_a_crash_answers_a_generic_500_and_logs_the_details(server, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("detail /home/operator/secret-path")

    monkeypatch.setattr(server.loop, "submit_samples", broken)
    with caplog.at_level(logging.ERROR, logger="jax_kvcached.serve"):
        r = complete(server)
    assert r.status_code == 500 and "secret-path" not in r.text
    assert r.json()["error"]["type"] == "server_error"
    assert "secret-path" in caplog.text  # the operator still sees it
    monkeypatch.undo()
    assert_serving(server)


def test_empty_keys_and_admin_beyond_loopback_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCACHED_API_KEY", raising=False)
    monkeypatch.delenv("KVCACHED_ADMIN_KEY", raising=False)
    with pytest.raises(ConfigError, match="api_key is empty"):
        ServeConfig(api_key="").auth()
    empty = tmp_path / "k"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="admin_key is empty"):
        ServeConfig(admin_key_file=str(empty)).auth()
    monkeypatch.setenv("KVCACHED_API_KEY", "")
    with pytest.raises(ConfigError, match="KVCACHED_API_KEY"):
        ServeConfig().auth()
    monkeypatch.delenv("KVCACHED_API_KEY")
    key = tmp_path / "admin"
    key.write_text("s3cret-admin\n")
    assert ServeConfig(admin_key_file=str(key)).auth().admin_key == "s3cret-admin"
    with pytest.raises(ConfigError, match="only with a loopback --host"):
        ServeConfig(host="0.0.0.0", allow_unauthenticated_admin=True).auth()
    assert ServeConfig(allow_unauthenticated_admin=True).auth().allow_unauthenticated_admin
    # the Host check: on for a loopback bind, off (any host) elsewhere unless given
    assert ServeConfig().hosts == ["127.0.0.1", "::1", "localhost"]
    assert ServeConfig(host="0.0.0.0").hosts is None
    assert ServeConfig(host="0.0.0.0", allowed_hosts="api.example").hosts == ["api.example"]


def test_a_compile_cache_another_user_could_fill_is_not_used(tmp_path, caplog):
    import jax

    before = jax.config.jax_compilation_cache_dir
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="jax_kvcached.serve"):
        assert enable_compile_cache(str(open_dir)) is None
    assert "writable by others (mode 777)" in caplog.text
    if os.getuid() == 0:  # (only root can give a folder away)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        assert "belongs to another user" in untrusted(str(theirs))
        assert enable_compile_cache(str(theirs)) is None
    assert jax.config.jax_compilation_cache_dir == before  # nothing of theirs is loaded
    # the engine's executable store (library users set JAX's cache themselves) refuses
    # the same folder: a stored "executable" there (a pickle, i.e. code) is never read
    from jax_kvcached.engine.executables import ExecutableStore

    planted = open_dir / "kvcached-executables"
    planted.mkdir(mode=0o700)
    (planted / "k.xla").write_bytes(b"not read")
    store = ExecutableStore(str(planted))
    assert not store.trusted and store.load("k", jax.devices("cpu")) is None
    assert (planted / "k.xla").read_bytes() == b"not read"
    assert ExecutableStore(str(tmp_path / "own" / "store")).trusted
    # a new folder is made private
    mine = tmp_path / "mine" / "xla"
    assert untrusted(str(tmp_path)) is None
    try:
        assert enable_compile_cache(str(mine)) == str(mine)
        assert (mine.stat().st_mode & 0o777) == 0o700
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_prompts_render_and_tokenize_off_the_event_loop(server, monkeypatch):
    """A large chat request's template and tokenizer run in a worker thread, so they do
    not stall other connections (the event loop runs in the server's own thread)."""
    import threading

    from jax_kvcached.serve.routes import generate

    seen = []
    real = generate.prepare

    def spy(ctx, req):
        seen.append(threading.current_thread())
        return real(ctx, req)

    monkeypatch.setattr(generate, "prepare", spy)
    assert complete(server, max_tokens=1).status_code == 200
    assert seen and seen[0] is not server.http.thread
    assert ServeConfig().max_connections > 0
    with pytest.raises(ConfigError, match="max_connections must be >= 1"):
        ServeConfig(max_connections=0)
