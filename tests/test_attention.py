"""Paged attention reads the KV cache in place: the host custom call, the XLA path and the
Pallas kernel (interpreted) against the dense reference for random shapes; the compiled
steps have no full-context concatenate, transpose or copy (the host path: no gather)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_kvcached as kv
from jax_kvcached.engine.attention import gqa_attention, host_paged_attention, paged_attention
from jax_kvcached.engine.pallas_attention import pallas_paged_attention
from jax_kvcached.engine.runner import ModelRunner, StepInput
from jax_kvcached.memory import ops
from jax_kvcached.models import BUILTIN_CONFIGS, build_model


def _reference(q, k_new, v_new, kc, vc, ctx, new):
    """Dense attention over [cached context, new tokens] per sequence."""
    b, t = q.shape[:2]
    out = []
    for i in range(b):
        keys = jnp.concatenate([kc[i, : ctx[i]], k_new[i]], 0)[None]
        vals = jnp.concatenate([vc[i, : ctx[i]], v_new[i]], 0)[None]
        ti = np.arange(t)
        mask = np.concatenate(
            [np.ones((t, ctx[i]), bool), (ti[None] <= ti[:, None]) & (ti[None] < new[i])], 1
        )
        out.append(gqa_attention(q[i : i + 1], keys, vals, jnp.asarray(mask)[None])[0])
    return jnp.stack(out)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(1, 3),
    t=st.sampled_from([1, 1, 3, 8]),
    groups=st.sampled_from([1, 2, 4]),
    kvh=st.integers(1, 3),
    bs=st.sampled_from([4, 16]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    impl=st.sampled_from(["host", "host-op", "xla", "pallas"]),
    data=st.data(),
)
def test_paged_attention_matches_dense(b, t, groups, kvh, bs, dtype, impl, data):
    d = 16
    pool = kv.Pool("16MiB", page_size="64KiB", backend="host", min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    c = pool.create_kv_cache("a", 1, kvh, d, dtype, block_size=bs)
    ctx = [data.draw(st.integers(0, 40)) for _ in range(b)]
    new = [data.draw(st.integers(1, t)) for _ in range(b)]
    nb = max(1, max(-(-x // bs) for x in ctx))
    rng = np.random.default_rng(sum(ctx) + 7 * t)
    tables = np.zeros((b, nb), np.int32)
    kc = rng.standard_normal((b, nb * bs, kvh, d)).astype(np.float32)
    vc = rng.standard_normal((b, nb * bs, kvh, d)).astype(np.float32)
    for i in range(b):
        n = -(-ctx[i] // bs)
        if n:
            tables[i, :n] = c.alloc(n)
            slots = c.slot_mapping(tables[i, :n], np.arange(ctx[i]))
            k = jnp.asarray(kc[i, : ctx[i]], dtype)[None]  # (layers, tokens, heads, dim)
            v = jnp.asarray(vc[i, : ctx[i]], dtype)[None]
            ops.write_kv(c, 0, k, v, slots, ops.new_token()).block_until_ready()
    q = jnp.asarray(rng.standard_normal((b, t, kvh * groups, d)), jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((b, t, kvh, d)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((b, t, kvh, d)), jnp.float32)

    def host_op(q, k_new, v_new, view, layer, tables, ctx_lens, new_lens):
        """The custom call itself, new tokens included (the runner's decode path)."""
        kn, vn = (x.astype(dtype).astype(jnp.float32) for x in (k_new, v_new))
        qg = q.reshape(b, t, kvh, groups, d)
        o, _, _ = ops.paged_attention(c, layer, qg, kn, vn, tables, ctx_lens, new_lens,
                                      ops.new_token())  # fmt: skip
        return o.reshape(q.shape)

    fn = {
        "host-op": host_op,
        "xla": paged_attention,
        "host": functools.partial(host_paged_attention, c, ops.new_token()),
        "pallas": functools.partial(pallas_paged_attention, num_splits=2, blocks_per_step=2,
                                    interpret=True),
    }[impl]  # fmt: skip
    got = jax.jit(fn, static_argnums=4)(
        q, k_new, v_new, c.view, 0, jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(new)
    )
    cast = lambda x: jnp.asarray(x, dtype).astype(jnp.float32)  # noqa: E731
    want = _reference(q, cast(k_new), cast(v_new), cast(kc), cast(vc), ctx, new)
    tol = 1e-5 if dtype == "float32" else 3e-2 if dtype == "bfloat16" else 3e-3
    for i in range(b):  # padded new rows are garbage by design
        np.testing.assert_allclose(got[i, : new[i]], want[i, : new[i]], atol=tol, rtol=tol)
    pool.close()


_INSTR = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(\w+)\(")


def _big_copies(hlo: str, elements: int) -> list[str]:
    """Instructions, fused or not, that concatenate, transpose or copy at least
    ``elements`` values (a fusion whose root is such a copy writes it to memory)."""
    out = []
    for line in hlo.splitlines():
        m = _INSTR.search(line)
        if not m or m.group(3) not in ("concatenate", "transpose", "copy"):
            continue
        dims = [int(x) for x in m.group(2).split(",") if x]
        if dims and int(np.prod(dims)) >= elements:
            out.append(line.strip()[:160])
    return out


@pytest.mark.parametrize("impl,t", [("xla", 1), ("host", 1), ("host", 16)])
def test_compiled_step_has_no_full_context_copy(t, impl):
    """Decode reads the context in place: no full-context concatenate, transpose or copy.
    A prefill chunk (compute-bound) may lay its gathered context out for a dense dot, but
    never concatenates it with the new tokens."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    model = build_model(cfg, seed=0)
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("a", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32")
    runner = ModelRunner(model, c, attention=impl)
    b, ctx = 8, 1024
    blocks = [c.alloc(ctx // 16 + 1).tolist() for _ in range(b)]
    batch = [StepInput([1] * t, ctx, blocks[i]) for i in range(b)]
    runner.run(batch).block_until_ready()
    (b_, t_, nb) = runner.shapes_for(batch)
    text = runner.lower((b_, t_, nb)).compile().as_text()
    full = b * nb * 16 * cfg.num_kv_heads * cfg.head_dim  # one layer's gathered K
    copies = _big_copies(text, full)
    if t > 1:
        copies = [x for x in copies if " concatenate(" in x]
    assert copies == [], copies
    if impl == "host" and t == 1:  # the custom call alone reads the KV: not even a gather
        assert text.count("kvcached_paged_attention") >= cfg.num_layers
        assert not re.search(rf"\[{b},{nb},16,[^\]]*\][^=]*gather\(", text)
    else:
        assert "gather" in text
    pool.close()


def test_the_detector_finds_the_old_concatenate():
    """The check above can fail: the previous attention (gather, concatenate with the new
    token, dot) compiles to full-context copies, and the detector reports them."""

    def old(q, k_new, view, tables, ctx):
        b, nb = tables.shape
        kc = view[0, 0, tables].reshape(b, nb * 16, 2, 32)
        vc = view[0, 1, tables].reshape(b, nb * 16, 2, 32)
        keys, vals = jnp.concatenate([kc, k_new], 1), jnp.concatenate([vc, k_new], 1)
        mask = jnp.arange(nb * 16 + 1)[None, None] <= ctx[:, None, None]
        return gqa_attention(q, keys, vals, jnp.broadcast_to(mask, (b, 1, nb * 16 + 1)))

    view = jnp.zeros((1, 2, 1025, 16, 2, 32))
    tables = jnp.arange(1024, dtype=jnp.int32).reshape(16, 64) + 1
    args = (jnp.ones((16, 1, 4, 32)), jnp.ones((16, 1, 2, 32)), view, tables, jnp.ones(16, int))
    text = jax.jit(old).lower(*args).compile().as_text()
    assert _big_copies(text, 16 * 64 * 16 * 2 * 32)


@pytest.mark.parametrize("t", [1, 5])
def test_runner_outputs_agree_across_attention_paths(t):
    cfg = BUILTIN_CONFIGS["tiny-qwen2"]
    model = build_model(cfg, seed=1)
    outs = {}
    for impl in ("xla", "host", "pallas-interpret"):
        pool = kv.Pool("32MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
        runner = ModelRunner(
            model,
            pool.create_kv_cache("a", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32"),
            attention=impl,
        )
        c = runner.cache
        blocks = [c.alloc(4).tolist() for _ in range(2)]
        first = runner.run([StepInput(list(range(1, 41)), 0, blocks[0]),
                            StepInput(list(range(7, 20)), 0, blocks[1])])  # fmt: skip
        then = runner.run([StepInput([5] * t, 40, blocks[0]), StepInput([9] * t, 13, blocks[1])])
        outs[impl] = (np.asarray(first), np.asarray(then))
        pool.close()
    for impl in ("host", "pallas-interpret"):
        for a, b in zip(outs["xla"], outs[impl], strict=True):
            np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)


def test_host_attention_validates_its_inputs():
    pool = kv.Pool("16MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("a", 2, 2, 32, "float32")
    blocks = c.alloc(2)
    q = jnp.ones((1, 1, 2, 2, 32), jnp.float32)

    kn = jnp.ones((1, 1, 2, 32), jnp.float32)

    def run(tables, ctx, layer=0, q=q, new=1):
        t, cl, nl = (jnp.asarray([x], jnp.int32) for x in (tables, ctx, new))
        out = ops.paged_attention(c, layer, q, kn, kn, t, cl, nl, ops.new_token())
        return jax.block_until_ready(out)[0]

    want = jnp.ones((1, 1, 2, 2, 32))  # every value is 1 (new token only: ctx 0 below)
    np.testing.assert_allclose(run(blocks.tolist(), 0), want, rtol=1e-6)
    run(blocks.tolist(), 20)  # fine
    from conftest import FFI_ERRORS

    for tables, ctx, msg in [
        ([int(blocks[0]), 0], 20, "not a block of this cache"),  # the null block in ctx
        ([int(blocks[0]), c.num_blocks], 20, "not a block of this cache"),
        (blocks.tolist(), 33, "out of range"),
        (blocks.tolist(), -1, "out of range"),
        ([int(blocks[0]), c.num_pages * c.blocks_per_page - 1], 20, "unmapped page"),
    ]:
        with pytest.raises(FFI_ERRORS, match=msg):
            run(tables, ctx)
    with pytest.raises(FFI_ERRORS, match="new_lens"):
        run(blocks.tolist(), 20, new=2)
    with pytest.raises(ValueError, match="layer"):
        run(blocks.tolist(), 20, layer=2)
    with pytest.raises(ValueError, match="float32"):
        run(blocks.tolist(), 20, q=q.astype(jnp.bfloat16))
    c.free(blocks)
    c.close()
    with pytest.raises(FFI_ERRORS, match="unknown or closed"):
        run(blocks.tolist(), 20)
    pool.close()
