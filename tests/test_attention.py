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
from jax_kvcached.engine.attention import (
    Ragged,
    gqa_attention,
    host_paged_attention,
    paged_attention,
    ragged_layout,
)
from jax_kvcached.engine.pallas_attention import item_tile, pallas_paged_attention
from jax_kvcached.engine.runner import ModelRunner, StepInput
from jax_kvcached.memory import ops
from jax_kvcached.models import BUILTIN_CONFIGS, build_model


def _reference(q, kc, vc, q_lens, kv_lens, window=0):
    """Dense causal attention of each sequence's query rows (the last q_lens of its
    kv_lens positions) over its keys (the last ``window`` ones, when > 0), laid out on the
    flat axis as the step lays them."""
    out, at = [], 0
    for s, (n, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        qs = q[at : at + n][None]
        pos = np.arange(kl - n, kl)
        mask = np.arange(kl)[None] <= pos[:, None]
        if window > 0:
            mask &= np.arange(kl)[None] > pos[:, None] - window
        out.append(gqa_attention(qs, kc[s, :kl][None], vc[s, :kl][None],
                                 jnp.asarray(mask)[None])[0])  # fmt: skip
        at += n
    return jnp.concatenate(out)


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seqs=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    kvh=st.integers(1, 3),
    bs=st.sampled_from([4, 16]),
    tile=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    impl=st.sampled_from(["host", "xla", "pallas", "pallas-flat"]),
    layer=st.integers(0, 1),
    window=st.sampled_from([0, 0, 1, 3, 8, 20]),
    data=st.data(),
)
def test_ragged_attention_matches_dense(
    seqs, groups, kvh, bs, tile, dtype, impl, layer, window, data
):
    """Decode rows and prefill chunks of several sequences on one flat axis (with padding
    rows and unused slots), every implementation against dense causal attention, reading
    one of two layers (the other holds other values) through a traced layer index.
    ``pallas-flat``: the kernel's compiled (GPU) way to the layer, interpreted: the
    layer's blocks found in the flat view by shifted ids. With a sliding ``window``, the
    blocks below every row's window are the null block in the tables (as a sliding
    group frees them): the host call must neither read nor check them."""
    d = 16
    pool = kv.Pool("16MiB", page_size="64KiB", backend="host", min_reserved_pages=0,
                   max_reserved_pages=0)  # fmt: skip
    c = pool.create_kv_cache("a", 2, kvh, d, dtype, block_size=bs)
    kv_lens = [data.draw(st.integers(1, 40)) for _ in range(seqs)]
    q_lens = [data.draw(st.integers(1, min(k, 1 if tile == 1 else 9))) for k in kv_lens]
    tokens = sum(q_lens) + data.draw(st.integers(0, 3))
    slots_n = seqs + data.draw(st.integers(0, 2))  # unused slots too
    nb = max(-(-x // bs) for x in kv_lens) + data.draw(st.integers(0, 2))
    rng = np.random.default_rng(sum(kv_lens) + 7 * tokens)
    tables = np.zeros((slots_n, nb), np.int32)
    kc = rng.standard_normal((seqs, nb * bs, kvh, d)).astype(np.float32)
    vc = rng.standard_normal((seqs, nb * bs, kvh, d)).astype(np.float32)
    for i in range(seqs):
        n = -(-kv_lens[i] // bs)
        tables[i, :n] = c.alloc(n)
        slots = c.slot_mapping(tables[i, :n], np.arange(kv_lens[i]))
        k = jnp.asarray(kc[i, : kv_lens[i]], dtype)  # (tokens, heads, dim)
        v = jnp.asarray(vc[i, : kv_lens[i]], dtype)
        kk, vv = jnp.stack([k, -v]), jnp.stack([v, -k])  # the other layer: other values
        if layer:
            kk, vv = kk[::-1], vv[::-1]
        ops.write_kv(c, 0, kk, vv, slots, ops.new_token()).block_until_ready()
    if window:  # blocks wholly below the sequence's first row's window: freed (null)
        for i in range(seqs):
            tables[i, : max(0, kv_lens[i] - q_lens[i] - window + 1) // bs] = 0
    q = jnp.asarray(rng.standard_normal((tokens, kvh * groups, d)), jnp.float32)
    if impl.startswith("pallas"):
        tile = min(tile, item_tile(groups))
    lay = Ragged(**{k: jnp.asarray(v) for k, v in
                    ragged_layout(q_lens, kv_lens, tables, tokens, tile).items()})  # fmt: skip
    fn = {
        "xla": paged_attention,
        "host": functools.partial(host_paged_attention, c, ops.new_token()),
        "pallas": functools.partial(pallas_paged_attention, num_splits=2, blocks_per_step=2,
                                    interpret=True),
        "pallas-flat": functools.partial(pallas_paged_attention, num_splits=2,
                                         blocks_per_step=2, interpret=True, slice_layer=False),
    }[impl]  # fmt: skip
    got = jax.jit(fn)(q, c.view, jnp.int32(layer), lay, window=jnp.int32(window))
    cast = lambda x: jnp.asarray(x, dtype).astype(jnp.float32)  # noqa: E731
    want = _reference(q, cast(kc), cast(vc), q_lens, kv_lens, window)
    tol = 1e-5 if dtype == "float32" else 3e-2 if dtype == "bfloat16" else 3e-3
    n = sum(q_lens)  # padding rows are garbage by design (the host call's are 0)
    np.testing.assert_allclose(got[:n], want, atol=tol, rtol=tol)
    assert np.isfinite(np.asarray(got)).all()
    pool.close()


_INSTR = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(\w+)\(")


def _big_copies(hlo: str, elements: int) -> list[str]:
    """Instructions, fused or not, that concatenate, transpose, copy or slice out (a
    layer's planes, by a traced layer index) at least ``elements`` values (a fusion whose
    root is such a copy writes it to memory)."""
    out = []
    for line in hlo.splitlines():
        m = _INSTR.search(line)
        if not m or m.group(3) not in ("concatenate", "transpose", "copy", "dynamic-slice"):
            continue
        dims = [int(x) for x in m.group(2).split(",") if x]
        if dims and int(np.prod(dims)) >= elements:
            out.append(line.strip()[:160])
    return out


@pytest.mark.parametrize("impl,t", [("xla", 1), ("xla", 16), ("host", 1), ("host", 16)])
def test_compiled_step_has_no_full_context_copy(t, impl):
    """Decode rows and prefill chunks read the context in place: no full-context
    concatenate, transpose or copy; the host path not even a gather (its custom call reads
    the blocks where they lie), for decode rows and chunks alike."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    model = build_model(cfg, seed=0)
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("a", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32")
    runner = ModelRunner(model, c, attention=impl, max_num_batched_tokens=128)
    b, ctx = 8, 1000
    blocks = [c.alloc(-(-(ctx + t) // 16)).tolist() for _ in range(b)]
    batch = [StepInput([1] * t, ctx, blocks[i]) for i in range(b)]
    runner.run(batch).block_until_ready()
    key = runner.shapes_for(batch)
    nb = key[1]
    text = runner.lower(key).compile().as_text()
    full = nb * 16 * cfg.num_kv_heads * cfg.head_dim  # one sequence's gathered K
    copies = _big_copies(text, full)
    if impl == "xla" and t > 1:  # a chunk (compute-bound) may lay its blocks out for a dot
        copies = [x for x in copies if " concatenate(" in x]
    assert copies == [], copies
    if impl == "host":  # a call per layer (unrolled on a CPU), or one in a scanned body
        calls = 1 if runner.scan_layers else cfg.num_layers
        assert text.count('custom_call_target="kvcached_paged_attention"') == calls
        assert not re.search(rf"\[\d+,{nb},16,[^\]]*\][^=]*gather\(", text)
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
    q = jnp.ones((2, 2, 2, 32), jnp.float32)  # 2 query rows, 2 KV heads, 2 groups
    ones = jnp.ones((1, 20, 2, 32), jnp.float32)
    slots = c.slot_mapping(blocks, np.arange(20))
    ops.write_kv(c, 0, ones, ones, slots, ops.new_token()).block_until_ready()

    def run(tables, kv_len, layer=0, q=q, q_start=(0,), q_len=(1,)):
        args = [jnp.asarray(x, jnp.int32) for x in ([tables], [kv_len], q_start, q_len)]
        if len(q_start) > 1:  # two sequences over the same blocks
            args[0], args[1] = jnp.asarray([tables] * 2), jnp.asarray([kv_len] * 2, jnp.int32)
        out = ops.paged_attention(c, layer, q, *args, ops.new_token())
        return jax.block_until_ready(out)

    got = run(blocks.tolist(), 20, q_len=(2,))
    np.testing.assert_allclose(got, np.ones((2, 2, 2, 32)), rtol=1e-6)  # every value is 1
    np.testing.assert_array_equal(run(blocks.tolist(), 20)[1], 0)  # a row of no sequence: 0
    from conftest import FFI_ERRORS

    for tables, kv_len, msg in [
        ([int(blocks[0]), 0], 20, "not a block of this cache"),  # the null block in range
        ([int(blocks[0]), c.num_blocks], 20, "not a block of this cache"),
        (blocks.tolist(), 33, "out of range"),
        (blocks.tolist(), -1, "out of range"),
        ([int(blocks[0]), c.num_pages * c.blocks_per_page - 1], 20, "unmapped page"),
    ]:
        with pytest.raises(FFI_ERRORS, match=msg):
            run(tables, kv_len)
    with pytest.raises(FFI_ERRORS, match="q_lens"):
        run(blocks.tolist(), 1, q_len=(2,))  # more query rows than the sequence's tokens
    with pytest.raises(FFI_ERRORS, match="runs past"):
        run(blocks.tolist(), 20, q_start=(1,), q_len=(2,))
    with pytest.raises(FFI_ERRORS, match="overlap"):
        run(blocks.tolist(), 20, q_start=(0, 0), q_len=(1, 1))
    with pytest.raises(ValueError, match="layer"):
        run(blocks.tolist(), 20, layer=2)
    with pytest.raises(FFI_ERRORS, match="layer 2 out of range"):  # an operand: the handler
        run(blocks.tolist(), 20, layer=jnp.int32(2))
    args = [jnp.asarray(x, jnp.int32) for x in ([blocks.tolist()], [20], (0,), (1,))]
    with pytest.raises(ValueError, match="window must be >= 0"):
        ops.paged_attention(c, 0, q, *args, ops.new_token(), -1)
    with pytest.raises(TypeError, match="window must be an int or an int32"):
        ops.paged_attention(c, 0, q, *args, ops.new_token(), 2.5)
    with pytest.raises(FFI_ERRORS, match="window = -1 must be >= 0"):  # traced: the handler
        jax.block_until_ready(ops.paged_attention(c, 0, q, *args, ops.new_token(),
                                                  jnp.int32(-1)))  # fmt: skip
    with pytest.raises(ValueError, match="float32"):
        run(blocks.tolist(), 20, q=q.astype(jnp.bfloat16))
    c.free(blocks)
    view = c.view
    c.close()
    with pytest.raises(kv.KVCacheError, match="is closed"):
        run(blocks.tolist(), 20)
    with pytest.raises(FFI_ERRORS, match="not an open KV cache's view"):  # its old view
        jax.block_until_ready(ops.paged_attention(c, 0, q, *args, ops.new_token(), view=view))
    pool.close()
