"""Sleep mode in the server: /admin/sleep and /admin/wake, requests that wake a sleeping
model (none lost, same answers, nothing compiled), --idle-sleep and --max-awake over
three models, sleep and wake from several threads, `ctl sleep` / `ctl wake` through a
process group, metrics and bad admin input."""

import dataclasses
import io
import random
import threading
import time
import uuid

import httpx
import pytest

import jax_kvcached as kv
from jax_kvcached import Engine
from jax_kvcached.engine.compile_events import compile_events
from jax_kvcached.memory import shm_segment
from jax_kvcached.models import ByteTokenizer
from jax_kvcached.serve.app import AuthConfig, BackgroundServer, ServedModel, create_app
from jax_kvcached.serve.ctl import run_ctl
from jax_kvcached.serve.loop import Conflict, ServingLoop
from jax_kvcached.serve.top import render, scrape

NAMES = ("a", "b", "c")
PROMPTS = ["The quick brown fox", "Virtual memory", "JAX is"]


@pytest.fixture(scope="module")
def engines():
    group = f"sleep-{uuid.uuid4().hex[:8]}"
    pool = kv.Pool("96MiB", backend="host", group=group, min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    engs = {
        n: Engine.from_pretrained("tiny-llama", pool, name=n, max_batch=4, host_cache_tokens=1024)
        for n in NAMES
    }
    # The answers awake, and every step shape compiled (so a wake must compile nothing).
    want = {n: [o.text for o in e.generate(PROMPTS, _params())] for n, e in engs.items()}
    for e in engs.values():
        e.reset_prefix_cache()
    yield engs, want, pool
    for e in engs.values():
        e.close()
    pool.close()
    shm_segment.remove(group)


def _params():
    from jax_kvcached import SamplingParams

    return SamplingParams(max_tokens=6, ignore_eos=True)


class _Served:
    def __init__(self, engs, **policy):
        self.loop = ServingLoop(engs, **policy).start()
        models = {n: ServedModel(e, ByteTokenizer()) for n, e in engs.items()}
        app = create_app(self.loop, models, auth=AuthConfig(allow_unauthenticated_admin=True))
        self.http = BackgroundServer(app).start()
        self.url = self.http.url

    def post(self, path, body):
        return httpx.post(f"{self.url}{path}", json=body, timeout=120)

    def complete(self, model, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = self.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def close(self):
        self.http.stop()
        self.loop.stop()


@pytest.fixture
def served(engines):
    engs, want, pool = engines
    made = []

    def make(**policy):
        s = _Served(engs, **policy)
        made.append(s)
        return s

    yield make, engs, want
    for s in made:
        s.close()
    for e in engs.values():  # every test starts with every model awake and empty
        if e.sleeping:
            e.wake()
        e.reset_prefix_cache()


def _awake(engs):
    return sorted(n for n, e in engs.items() if not e.sleeping)


def test_admin_sleep_and_wake_answer_the_same_and_compile_nothing(served):
    make, engs, want = served
    s = make()
    for n in ("a", "b"):  # the same requests once awake: every shape they need compiled
        assert [s.complete(n, p) for p in PROMPTS] == want[n]
    compiled = compile_events()
    r = s.post("/admin/sleep", {"model": "a", "level": 1})
    assert r.status_code == 200, r.text
    assert r.json()["weight_bytes"] > 0 and r.json()["mapped_pages"] == 0
    assert engs["a"].sleeping and engs["a"].cache.num_mapped_pages == 0
    mem = httpx.get(f"{s.url}/admin/memory").json()["models"]
    assert (mem["a"]["sleeping"], mem["a"]["sleep_level"]) == (True, 1)
    assert mem["b"]["sleeping"] is False
    frame = render(scrape(s.url))
    assert "a ASLEEP" in frame and "b ASLEEP" not in frame
    # A request to the sleeping model wakes it and gets the same answer.
    assert s.complete("a", PROMPTS[0]) == want["a"][0]
    assert not engs["a"].sleeping and s.loop.wakes["a"] == 1
    assert s.loop.last_wake["a"]["compiled"] == 0 and compile_events() == compiled
    # Level 2 drops the weights (the engines came from checkpoints) and reads them again.
    assert s.post("/admin/sleep", {"model": "b", "level": 2}).status_code == 200
    assert s.post("/admin/wake", {"model": "b"}).json()["level"] == 2
    assert [s.complete("b", p) for p in PROMPTS] == want["b"]
    metrics = httpx.get(f"{s.url}/metrics").text
    assert 'kvcached_model_sleeping{model="a"} 0.0' in metrics
    assert 'kvcached_model_wakes_total{model="b"} 1.0' in metrics
    assert 'kvcached_wake_seconds_count{model="a"} 1.0' in metrics
    assert compile_events() == compiled


def test_bad_admin_input_is_a_clear_4xx(served):
    make, engs, _ = served
    s = make()
    cases = [
        ("/admin/sleep", {"model": "nope"}, 404),
        ("/admin/sleep", {"model": "a", "level": 3}, 400),
        ("/admin/sleep", {"model": "a", "level": True}, 400),
        ("/admin/sleep", {"model": "a", "abort": "yes"}, 400),
        ("/admin/sleep", {"level": 1}, 400),
        ("/admin/sleep", {"model": "a", "colour": 1}, 400),
        ("/admin/wake", {"model": "a"}, 409),  # awake
        ("/admin/wake", {"model": 7}, 400),
    ]
    for path, body, status in cases:
        r = s.post(path, body)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["message"]
    assert s.post("/admin/sleep", {"model": "a"}).status_code == 200
    r = s.post("/admin/sleep", {"model": "a"})
    assert r.status_code == 409 and "asleep already" in r.json()["error"]["message"]
    assert _awake(engs) == ["b", "c"]


def test_requests_sent_while_asleep_are_all_served(served):
    make, engs, want = served
    s = make()
    s.loop.sleep("a")
    got, errors = {}, []

    def ask(i):
        try:
            got[i] = s.complete("a", PROMPTS[i % 3])
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 9
    assert all(got[i] == want["a"][i % 3] for i in range(9))
    assert s.loop.wakes["a"] == 1  # one wake served all of them
    engs["a"].reset_prefix_cache()
    assert engs["a"].cache.num_mapped_pages == 0  # accounting exact


def test_a_failed_wake_fails_its_requests_alone_and_is_retried(served, monkeypatch):
    make, engs, want = served
    s = make()
    s.loop.sleep("a")
    wake = engs["a"].wake
    calls = []

    def flaky(**kw):
        calls.append(kw)
        if len(calls) == 1:
            raise RuntimeError("injected: host memory gone")
        return wake(**kw)

    monkeypatch.setattr(engs["a"], "wake", flaky)
    body = {"model": "a", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    r = s.post("/v1/completions", body)
    assert r.status_code == 503 and "waking model 'a' failed" in r.json()["error"]["message"]
    assert engs["a"].sleeping and s.loop.wake_failures["a"] == 1
    assert s.complete("b", PROMPTS[0]) == want["b"][0]  # the others go on
    assert s.complete("a", PROMPTS[0]) == want["a"][0]  # retried by the next request
    assert not engs["a"].sleeping


def test_sleep_with_abort_ends_the_running_request(served):
    make, engs, _ = served
    s = make()
    body = {"model": "a", "prompt": "long", "max_tokens": 400, "ignore_eos": True}
    box = {}
    t = threading.Thread(target=lambda: box.update(r=s.post("/v1/completions", body)))
    t.start()
    deadline = time.monotonic() + 60
    while not engs["a"].num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    r = s.post("/admin/sleep", {"model": "a", "abort": True})
    t.join(60)
    assert r.status_code == 200 and engs["a"].sleeping
    assert box["r"].status_code == 503 and "put to sleep" in box["r"].text
    assert engs["a"].cache.num_mapped_pages == 0


def test_max_awake_sleeps_the_least_recently_used_idle_model(served):
    make, engs, want = served
    s = make(max_awake=2)
    s.loop.sleep("c")
    assert _awake(engs) == ["a", "b"]
    assert s.complete("a", PROMPTS[0]) == want["a"][0]
    assert s.complete("b", PROMPTS[0]) == want["b"][0]
    assert s.complete("c", PROMPTS[1]) == want["c"][1]  # a is the LRU one: it sleeps
    assert _awake(engs) == ["b", "c"]
    assert s.complete("a", PROMPTS[2]) == want["a"][2]  # now b sleeps
    assert _awake(engs) == ["a", "c"]
    with pytest.raises(Conflict, match="is awake"):
        s.loop.wake("a")


def test_idle_sleep_puts_an_unused_model_to_sleep(served):
    make, engs, want = served
    s = make(idle_sleep_s=0.3)
    assert s.complete("a", PROMPTS[0]) == want["a"][0]
    deadline = time.monotonic() + 30
    while _awake(engs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _awake(engs) == []  # all three, a included, idle past 0.3 s
    assert all(e.cache.num_mapped_pages == 0 for e in engs.values())
    assert s.complete("b", PROMPTS[1]) == want["b"][1]  # a request wakes it


def test_sleep_wake_and_requests_from_many_threads(served):
    make, engs, want = served
    s = make(max_awake=2)
    stop = time.monotonic() + 4
    errors, answers, finished = [], {k: [] for k in range(4)}, []

    def client(k):
        rng = random.Random(k)
        try:
            while time.monotonic() < stop:
                n, i = rng.choice(NAMES), rng.randrange(3)
                answers[k].append(s.complete(n, PROMPTS[i]) == want[n][i])
        except BaseException as e:  # (any failure is the test's: counted, not lost)
            errors.append(e)
        finished.append(("client", k))

    def admin(k):
        rng = random.Random(100 + k)
        try:
            while time.monotonic() < stop:
                n = rng.choice(NAMES)
                try:
                    if rng.random() < 0.5:
                        s.loop.sleep(n, timeout=60)
                    else:
                        s.loop.wake(n, timeout=60)
                except Conflict:
                    pass  # asleep already, awake already, or no idle model to make room
                time.sleep(0.02)
        except BaseException as e:
            errors.append(e)
        finished.append(("admin", k))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=admin, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)  # no deadlock
    assert not errors, errors
    assert len(finished) == 6  # every thread ran to its end
    # Every client was answered, every answer right (none lost or wrong).
    assert all(a and all(a) for a in answers.values()), answers
    assert sum(s.loop.wakes.values()) > 0 and sum(s.loop.sleeps.values()) > 0
    assert len(_awake(engs)) <= 2
    for e in engs.values():
        if not e.sleeping:
            e.reset_prefix_cache()
        assert e.cache.num_mapped_pages == 0


def test_ctl_sleeps_and_wakes_a_model_of_the_group(served):
    make, engs, want = served
    s = make()
    group = engs["a"].pool.group
    out = io.StringIO()
    assert run_ctl("sleep", group, "a", out=out, timeout=30) == 0
    assert engs["a"].sleeping and "a: asleep1" in out.getvalue()
    listing = io.StringIO()
    run_ctl("list", group, out=listing)
    rows = {ln.split()[0]: ln for ln in listing.getvalue().splitlines()[2:]}
    assert rows["a"].endswith("asleep1") and rows["b"].endswith("awake")
    assert run_ctl("wake", group, "a", out=out, timeout=30) == 0
    assert not engs["a"].sleeping and s.complete("a", PROMPTS[0]) == want["a"][0]
    with pytest.raises(KeyError, match="no tenant named"):
        run_ctl("sleep", group, "nope", out=out)


def test_a_stop_past_a_stuck_step_ends_parked_requests_and_commands(served, monkeypatch):
    """When stop() gives up on a loop thread stuck in a step, the request parked for a
    wake and a wake command not yet taken end with the shutdown error (no caller waits
    out its timeout); the loop thread, once free, answers neither again."""
    from jax_kvcached.serve.errors import Unavailable

    make, engs, _ = served
    engs["a"].sleep()
    engs["c"].sleep()
    release, stuck = threading.Event(), threading.Event()
    step, calls = engs["b"].step, []

    def slow_step():
        calls.append(1)
        # Once a's request is parked, b's next step hangs (a compile, say).
        if not stuck.is_set() and loop.stats()["a"]["waiting_for_wake"] == 1:
            stuck.set()
            release.wait(60)
        return step()

    monkeypatch.setattr(engs["b"], "step", slow_step)
    loop = ServingLoop(engs, max_awake=1).start()
    events = {"a": [], "b": []}
    params = dataclasses.replace(_params(), max_tokens=50)
    loop.submit("b", PROMPTS[0], params, lambda k, v: events["b"].append(k))
    while not calls:
        time.sleep(0.005)
    # b is busy: a cannot wake under max_awake=1, so its request is parked.
    loop.submit("a", PROMPTS[1], _params(), lambda k, v: events["a"].append((k, v)))
    assert stuck.wait(60)
    box = {}
    waker = threading.Thread(target=lambda: box.update(r=_outcome(lambda: loop.wake("c"))))
    waker.start()
    time.sleep(0.2)  # the wake command waits in the queue of the stuck loop
    assert loop.stop(timeout=0.5) is False  # given up: ended from this thread
    waker.join(10)
    kinds = [k for k, _ in events["a"] if k != "token"]
    assert kinds == ["error"] and isinstance(events["a"][-1][1], Unavailable)
    assert isinstance(box["r"], Unavailable) and "shutting down" in str(box["r"])
    assert events["b"][-1] == "error"
    release.set()
    time.sleep(0.5)  # the loop thread finishes its step and its shutdown
    assert [k for k, _ in events["a"] if k != "token"] == ["error"]  # nothing twice


def _outcome(fn):
    try:
        return fn()
    except Exception as e:
        return e
