"""The pool in a user's own jitted loop (the README's "your own Flax loop"): a KV cache
passed to the jitted step as an argument is read and written in place, and its logits
equal an eager run's and a no-cache run's, over MHA / GQA / MQA, head dims 16-128 and
block sizes 8-64, two tenants on one pool and block tables that grow every step. A step
that reads a snapshot of the view fails the same check (the check can fail); a closure
over the cache is refused."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached import ops

VOCAB, EMBED, LAYERS = 64, 32, 2
# (heads, KV heads, head dim, block size): MHA, GQA, MQA and GQA again
SHAPES = [(4, 4, 16, 8), (4, 2, 32, 16), (8, 1, 128, 64), (6, 2, 64, 32)]
PROMPTS = [[3, 9, 12, 5, 40], [7, 1, 60]]
CHUNK = 8  # teacher-forced tokens per sequence and step: a block of 8 fills every step


def _params(shape, seed):
    h, kvh, d, _ = shape
    rng = np.random.default_rng(seed)

    def w(*s):
        return jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)

    layers = [dict(q=w(EMBED, h * d), k=w(EMBED, kvh * d), v=w(EMBED, kvh * d),
                   o=w(h * d, EMBED)) for _ in range(LAYERS)]  # fmt: skip
    return dict(embed=w(VOCAB, EMBED) * 4, layers=layers, head=w(EMBED, VOCAB))


def _forward(params, ids, shape, attend):
    """A small attention-only model: ``attend(layer, q, k, v) -> (T, H, D)``."""
    h, kvh, d, _ = shape
    x = params["embed"][ids]
    for i, p in enumerate(params["layers"]):
        q = (x @ p["q"]).reshape(-1, h, d)
        k = (x @ p["k"]).reshape(-1, kvh, d)
        v = (x @ p["v"]).reshape(-1, kvh, d)
        x = x + attend(i, q, k, v).reshape(len(ids), -1) @ p["o"]
    return x @ params["head"]


def _dense_attend(layer, q, k, v):
    return kv.dense_causal_attention(q[None], k[None], v[None])[0]


_dense_forward = jax.jit(functools.partial(_forward, attend=_dense_attend), static_argnums=2)


def _dense(params, seq, shape):
    """No-cache logits of a whole sequence (padded at the end to a multiple of 32: causal,
    so the padding changes no earlier row; one program per shape)."""
    ids = np.zeros(-(-len(seq) // 32) * 32, np.int32)
    ids[: len(seq)] = seq
    return np.asarray(_dense_forward(params, jnp.asarray(ids), shape))[: len(seq)]


def _step(params, cache, ids, slots, lay, token, *, shape, snapshot=None):
    """One ragged step: each layer writes its K/V, then attends over the cache (or, the
    mutation, over ``snapshot``: a copy of the view from before the step)."""
    chain = [token]

    def attend(layer, q, k, v):
        chain[0] = ops.write_kv(cache, layer, k, v, slots, chain[0])
        after = dataclasses.replace(lay, tables=ops.after(lay.tables, chain[0]))
        return kv.paged_attention(q, cache.view if snapshot is None else snapshot, layer, after)

    return _forward(params, ids, shape, attend), chain[0]


class Tenant:
    """One model's sequences in one cache of the pool, stepped by a given step function."""

    def __init__(self, pool, name, shape, seed):
        h, kvh, d, bs = self.shape = shape
        self.cache = pool.create_kv_cache(name, LAYERS, kvh, d, jnp.float32, block_size=bs)
        self.params = _params(shape, seed)
        self.seqs: list[list[int]] = [[] for _ in PROMPTS]
        self.blocks: list[list[int]] = [[] for _ in PROMPTS]
        self.width = 8  # block-table columns (fixed: one compiled program a step shape)
        self.rng = np.random.default_rng(seed)
        self.token = ops.new_token()
        self.errors: list[float] = []

    def step(self, run, new, snapshot=False):
        """Appends ``new`` tokens to each sequence through ``run``; returns each new row's
        logits minus the no-cache run's, and records the worst."""
        bs = self.shape[3]
        lens = [len(s) + len(n) for s, n in zip(self.seqs, new, strict=True)]
        for b, n in zip(self.blocks, lens, strict=True):  # the tables grow as needed
            while len(b) * bs < n:
                b.append(int(self.cache.alloc(1)[0]))
        tables = np.zeros((len(new), self.width), np.int32)
        for i, b in enumerate(self.blocks):
            tables[i, : len(b)] = b
        pos = np.concatenate([np.arange(len(s), len(s) + len(n)) for s, n in
                              zip(self.seqs, new, strict=True)])  # fmt: skip
        row = np.repeat(np.arange(len(new)), [len(n) for n in new])
        slots = tables[row, pos // bs] * bs + pos % bs
        lay = kv.Ragged.of([len(n) for n in new], lens, tables)
        ids = np.concatenate(new).astype(np.int32)
        extra = {"snapshot": self.cache.view + 0} if snapshot else {}
        logits, self.token = run(self.params, self.cache, ids, slots, lay, self.token, **extra)
        logits = np.asarray(logits)
        out, start = [], 0
        for i, n in enumerate(new):
            self.seqs[i] += list(n)
            want = _dense(self.params, self.seqs[i], self.shape)[-len(n):]
            out.append(logits[start : start + len(n)] - want)
            start += len(n)
        self.errors.append(max(float(np.abs(e).max()) for e in out))
        return logits

    def run_loop(self, run, steps=3, decode=4, snapshot=False):
        """Prefill, ``steps`` teacher-forced chunks of CHUNK tokens (a new block a step at
        block size 8), then ``decode`` greedy steps."""
        logits = self.step(run, [list(p) for p in PROMPTS], snapshot)
        for _ in range(steps):
            self.step(run, [self.rng.integers(0, VOCAB, CHUNK).tolist() for _ in self.seqs],
                      snapshot)  # fmt: skip
        for _ in range(decode):
            last = np.cumsum([1] * len(self.seqs)) - 1
            logits = self.step(run, [[int(t)] for t in np.argmax(logits[last], -1)], snapshot)
        return max(self.errors)

    def close(self):
        self.cache.free([b for bs in self.blocks for b in bs], after=self.token)


def _jitted(shape):
    return jax.jit(lambda *a, **k: _step(*a, shape=shape, **k))


@pytest.fixture(scope="module")
def pool():
    p = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    yield p
    p.close()


@pytest.mark.parametrize("shape", SHAPES, ids=["mha-d16-b8", "gqa-d32-b16", "mqa-d128-b64",
                                               "gqa-d64-b32"])  # fmt: skip
def test_the_cache_as_an_argument_equals_eager_and_dense(pool, shape):
    jitted, eager = Tenant(pool, "jit", shape, 1), Tenant(pool, "eager", shape, 1)
    assert jitted.run_loop(_jitted(shape)) < 1e-4  # against the no-cache run
    # The same step eagerly (op by op: a shorter run), the same logits and tokens.
    assert eager.run_loop(lambda *a, **k: _step(*a, shape=shape, **k), decode=1) < 1e-4
    for e, j in zip(eager.seqs, jitted.seqs, strict=True):
        assert j[: len(e)] == e
    for t in (jitted, eager):
        t.close()
        t.cache.close()
    assert pool.stats()["mapped_pages"] == 0  # exact accounting: everything given back


def test_two_tenants_on_one_pool_step_in_turn(pool):
    """Two models of different layouts on one budget, their steps interleaved, each with
    tables that grow every step."""
    a, b = Tenant(pool, "a", SHAPES[0], 2), Tenant(pool, "b", SHAPES[2], 3)
    runs = {a: _jitted(a.shape), b: _jitted(b.shape)}
    for t in (a, b):
        t.step(runs[t], [list(p) for p in PROMPTS])
    grew = []
    for _ in range(3):
        before = [len(x) for x in a.blocks]
        for t in (a, b):
            t.step(runs[t], [t.rng.integers(0, VOCAB, CHUNK).tolist() for _ in t.seqs])
        grew.append([len(x) for x in a.blocks] > before)
    assert all(grew)  # a block more for each of a's sequences every step (block size 8)
    assert max(a.errors) < 1e-4 and max(b.errors) < 1e-4
    stats = pool.stats()["caches"]
    assert stats["a"]["mapped_pages"] > 0 and stats["b"]["mapped_pages"] > 0
    for t in (a, b):
        t.close()
        t.cache.close()
    assert pool.stats()["mapped_pages"] == 0


def test_a_snapshot_of_the_view_fails_the_check(pool):
    """The mutation: the same jitted step reading a copy of the view taken before it (what
    a closure bakes into a program) is far from the no-cache logits."""
    t = Tenant(pool, "snap", SHAPES[1], 4)
    err = t.run_loop(_jitted(t.shape), steps=1, decode=1, snapshot=True)
    assert err > 0.1, err
    t.close()
    t.cache.close()


def test_a_closure_over_the_cache_is_refused(pool):
    t = Tenant(pool, "closure", SHAPES[1], 5)
    closure = jax.jit(lambda params, ids, slots, lay, token: _step(
        params, t.cache, ids, slots, lay, token, shape=t.shape))  # fmt: skip
    with pytest.raises(ValueError, match="pass the cache to the function as an argument"):
        t.step(lambda p, c, *a: closure(p, *a), [list(p) for p in PROMPTS])
    # and the public attention alone, given a closed-over view
    q = jnp.ones((2, 4, 32), jnp.float32)
    lay = kv.Ragged.of([1, 1], [1, 1], np.zeros((2, 8), np.int32))
    with pytest.raises(ValueError, match="pass the cache"):
        jax.jit(lambda q: kv.paged_attention(q, t.cache.view, 0, lay))(q)
    t.cache.close()


def test_under_nnx_jit_the_view_is_a_parameter_read_in_place(pool):
    """Under ``nnx.jit`` too, the cache is an argument like any pytree: the same logits as
    ``jax.jit``. In the compiled program the view is an entry parameter that the custom
    calls take as it is: no copy of the buffer (a snapshot would be one)."""
    from flax import nnx

    shape = SHAPES[1]
    a, b = Tenant(pool, "nnx", shape, 6), Tenant(pool, "jax", shape, 6)
    step = nnx.jit(lambda *x, **k: _step(*x, shape=shape, **k))
    assert a.run_loop(step, steps=1, decode=2) < 1e-4
    b.run_loop(_jitted(shape), steps=1, decode=2)
    assert a.seqs == b.seqs and a.errors == pytest.approx(b.errors, abs=1e-6)

    def hlo(step):
        lay = kv.Ragged.of([1, 1], [1, 1], np.zeros((2, a.width), np.int32))
        args = (a.params, a.cache, np.zeros(2, np.int32), np.zeros(2, np.int32), lay, a.token)
        return jax.jit(step).lower(*args).compile().as_text()

    dims = ",".join(map(str, a.cache.view.shape))
    text = hlo(functools.partial(_step, shape=shape))
    entry = text[text.index("ENTRY") :]
    params = re.findall(rf"(\S+) = f32\[{dims}\][^ ]* parameter\(", entry)
    assert len(params) == 1, params  # the view: one parameter of the program
    calls = [x for x in entry.splitlines() if "custom-call(" in x and "kvcached_" in x]
    assert all(params[0] in x for x in calls)  # each call takes it as it is
    # (kv.paged_attention is the XLA path: its gathers read the blocks, no view copied)
    assert {re.search(r'custom_call_target="(\w+)"', x).group(1) for x in calls} == {
        "kvcached_write_kv"}  # fmt: skip
    copy = re.compile(rf"= f32\[{dims}\][^ ]* (copy|fusion)\(")
    assert not copy.search(text)
    # the check can fail: a step whose calls get a computed copy of the view holds it
    # (compiled only: run, the calls would refuse a buffer that is not the cache's)
    copied = hlo(lambda p, c, *x: _step(p, c.with_view(c.view + 1), *x, shape=shape))
    assert copy.search(copied)
    for t in (a, b):
        t.close()
        t.cache.close()
