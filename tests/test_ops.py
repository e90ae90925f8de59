import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FFI_ERRORS, make_cache

import jax_kvcached as kv
from jax_kvcached.memory import ops


def _rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_then_read_in_one_step(pool, dtype):
    c = make_cache(pool, layers=3, dtype=dtype)
    ids = c.alloc(3)
    n = 40
    slots = c.slot_mapping(ids, np.arange(n))
    k, v = _rand((n, 2, 64), dtype, 0), _rand((n, 2, 64), dtype, 1)

    @jax.jit
    def step(cache, k, v, slots, token):  # the cache an argument: its view a buffer
        token = ops.write_kv(cache, 2, k, v, slots, token)
        s = ops.after(slots, token)
        blocks, offs = s // c.block_size, s % c.block_size
        return cache.view[2, 0, blocks, offs], cache.view[2, 1, blocks, offs], token

    rk, rv, _ = step(c, k, v, jnp.asarray(slots), ops.new_token())
    np.testing.assert_array_equal(np.asarray(rk), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(rv), np.asarray(v))
    # Other layers and other slots stay zero.
    assert float(jnp.abs(c.view[:2].astype(jnp.float32)).sum()) == 0.0
    flat = np.asarray(c.view[2, 0].astype(jnp.float32)).reshape(-1, 2, 64)
    mask = np.ones(flat.shape[0], bool)
    mask[slots] = False
    assert np.abs(flat[mask]).sum() == 0.0


def test_writes_persist_across_steps_and_skip_padding(pool):
    c = make_cache(pool)
    ids = c.alloc(2)
    write = jax.jit(lambda c, k, v, s, t: ops.write_kv(c, 1, k, v, s, t))
    token = ops.new_token()
    expected = np.zeros((32, 2, 64), np.float32)
    for pos in range(32):
        slot = c.slot_mapping(ids, np.array([pos]))
        slots = jnp.asarray(np.array([slot[0], -1], np.int32))  # second token is padding
        k = jnp.full((2, 2, 64), pos + 1.0)
        token = write(c, k, -k, slots, token)
        expected[pos] = pos + 1.0
    token.block_until_ready()
    got = np.asarray(c.view[1, 0, ids]).reshape(32, 2, 64)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.asarray(c.view[1, 1, ids]).reshape(32, 2, 64), -expected)


def test_copy_blocks(pool):
    c = make_cache(pool)
    ids = c.alloc(4)
    slots = c.slot_mapping(ids[:2], np.arange(32))
    k = _rand((32, 2, 64), "float32", 3)
    t = ops.write_kv(c, 0, k, 2 * k, slots, ops.new_token())
    t = ops.write_kv(c, 1, 3 * k, 4 * k, slots, t)
    t = ops.copy_blocks(c, ids[:2], ids[2:], t)
    t.block_until_ready()
    view = np.asarray(c.view)
    np.testing.assert_array_equal(view[:, :, ids[2:]], view[:, :, ids[:2]])
    assert np.abs(view[:, :, ids[2:]]).sum() > 0


def test_map_and_unmap_pages_inside_jit(pool):
    c = make_cache(pool)
    page = c.num_pages - 1  # far from the allocator's pages
    block = page * c.blocks_per_page
    slots = jnp.arange(block * 16, block * 16 + 16, dtype=jnp.int32)
    k = jnp.ones((16, 2, 64))

    @jax.jit
    def step(view, token):  # (the view alone as the argument, given to each op)
        token = ops.map_pages(c, jnp.array([page]), token, view=view)
        token = ops.write_kv(c, 0, k, k, slots, token, view=view)
        b = ops.after(jnp.array([block]), token)
        total = view[0, 0, b].sum()
        token = ops.unmap_pages(c, jnp.array([page]), token, total, view=view)
        return total, token

    total, token = step(c.view, ops.new_token())
    token.block_until_ready()
    assert float(total) == 16 * 2 * 64
    assert not c.is_page_mapped(page)
    assert pool.stats()["mapped_pages"] == 0
    assert float(c.view[0, 0, block].sum()) == 0.0  # unmapped again: zeros


def _run(fn):
    out = fn()
    jax.block_until_ready(out)
    return out


@pytest.mark.parametrize(
    "slots,match",
    [
        ([-2], "out of range"),
        ([10**8], "out of range"),
        ([3], "null block"),
        (None, "unmapped page"),
    ],
)
def test_write_kv_rejects_bad_slots(pool, slots, match):
    c = make_cache(pool)
    c.alloc(1)
    if slots is None:
        slots = [c.blocks_per_page * 16 * 5]  # page 5 is not mapped
    k = jnp.ones((1, 2, 64))
    with pytest.raises(FFI_ERRORS, match=match):
        _run(lambda: ops.write_kv(c, 0, k, k, jnp.asarray(slots, jnp.int32), ops.new_token()))
    assert float(jnp.abs(c.view).sum()) == 0.0  # nothing written


def test_write_kv_rejects_bad_layer_shape_dtype(pool):
    c = make_cache(pool)
    ids = c.alloc(1)
    s = jnp.asarray(c.slot_mapping(ids, np.arange(2)))
    k = jnp.ones((2, 2, 64))
    with pytest.raises(FFI_ERRORS, match="layer 2 out of range"):
        _run(lambda: ops.write_kv(c, 2, k, k, s, ops.new_token()))
    with pytest.raises(ValueError, match="shape"):
        ops.write_kv(c, 0, jnp.ones((2, 3, 64)), k, s, ops.new_token())
    with pytest.raises(TypeError, match="dtype"):
        ops.write_kv(c, 0, k.astype(jnp.bfloat16), k, s, ops.new_token())
    with pytest.raises(ValueError, match="1-D"):
        ops.write_kv(c, 0, k, k, s.reshape(1, 2), ops.new_token())


def test_handlers_validate_shapes_themselves(pool):
    """Calls the custom call directly, bypassing the Python checks. On the host backend
    the view is the first operand: the handler finds the cache by its address."""
    c = make_cache(pool)
    ids = c.alloc(1)
    s = jnp.asarray(c.slot_mapping(ids, np.arange(2)))
    token_type = jax.ShapeDtypeStruct((), jnp.int32)
    call = jax.ffi.ffi_call("kvcached_write_kv", token_type, has_side_effect=True)
    bad_k = jnp.ones((2, 2, 32))
    with pytest.raises(FFI_ERRORS, match="shape"):
        _run(lambda: call(c.view, jnp.int32(0), bad_k, bad_k, s, ops.new_token()))
    k16 = jnp.ones((2, 2, 64), jnp.float16)
    with pytest.raises(FFI_ERRORS, match="dtype"):
        _run(lambda: call(c.view, jnp.int32(0), k16, k16, s, ops.new_token()))
    k = jnp.ones((2, 2, 64))
    # a copy of the view (what a closure would bake into a program), or any other array
    with pytest.raises(FFI_ERRORS, match="not an open KV cache's view"):
        _run(lambda: call(c.view + 0, jnp.int32(0), k, k, s, ops.new_token()))
    with pytest.raises(FFI_ERRORS, match="not an open KV cache's view"):
        _run(lambda: call(jnp.ones(4), jnp.int32(0), k, k, s, ops.new_token()))
    assert float(jnp.abs(c.view).sum()) == 0.0  # nothing written


def test_bad_handle_page_and_copy_errors(pool):
    c = make_cache(pool)
    ids = c.alloc(2)
    t = ops.new_token()
    with pytest.raises(FFI_ERRORS, match="out of range"):
        _run(lambda: ops.map_pages(c, jnp.array([c.num_pages]), t))
    with pytest.raises(FFI_ERRORS, match="already mapped"):
        _run(lambda: ops.map_pages(c, jnp.array([0]), t))
    with pytest.raises(FFI_ERRORS, match="not mapped"):
        _run(lambda: ops.unmap_pages(c, jnp.array([3]), t))
    with pytest.raises(FFI_ERRORS, match="twice"):
        _run(lambda: ops.map_pages(c, jnp.array([4, 4]), t))
    with pytest.raises(FFI_ERRORS, match="null block"):
        _run(lambda: ops.copy_blocks(c, jnp.array([ids[0]]), jnp.array([0]), t))
    with pytest.raises(FFI_ERRORS, match="unmapped page"):
        _run(lambda: ops.copy_blocks(c, jnp.array([ids[0]]), jnp.array([c.num_blocks - 1]), t))
    with pytest.raises(FFI_ERRORS, match="both a source and a destination"):
        _run(lambda: ops.copy_blocks(c, jnp.array(ids), jnp.array(ids[::-1]), t))
    with pytest.raises(ValueError, match="length"):
        ops.copy_blocks(c, jnp.array(ids), jnp.array(ids[:1]), t)
    assert pool.stats()["mapped_pages"] == 4  # failed ops changed nothing


def test_map_pages_op_reports_exhaustion(pool):
    c = make_cache(pool)
    everything = jnp.arange(c.num_pages, dtype=jnp.int32)
    assert c.num_pages * c.pages_per_kv_page == pool.budget_pages
    extra = pool.create_kv_cache("b", 1, 2, 64, "float32")
    extra.alloc(1)  # two pages taken: `everything` no longer fits
    with pytest.raises(FFI_ERRORS, match="RESOURCE_EXHAUSTED"):
        _run(lambda: ops.map_pages(c, everything, ops.new_token()))
    assert c.num_mapped_pages == 0


def test_closed_cache_handle_is_rejected(pool):
    c = make_cache(pool)
    c.alloc(1)
    k = jnp.ones((1, 2, 64))
    view = c.view
    c.close()
    with pytest.raises(kv.KVCacheError, match="'a' is closed"):
        ops.write_kv(c, 0, k, k, jnp.array([16], jnp.int32), ops.new_token())
    with pytest.raises(FFI_ERRORS, match="not an open KV cache's view"):  # its old view
        _run(lambda: ops.write_kv(c, 0, k, k, jnp.array([16], jnp.int32), ops.new_token(),
                                  view=view))  # fmt: skip


def test_after_rejects_float_arrays():
    with pytest.raises(TypeError, match="integer"):
        ops.after(jnp.ones(3), ops.new_token())


def test_pool_exhausted_is_a_kvcache_error():
    assert issubclass(kv.PoolExhausted, kv.KVCacheError)
    assert issubclass(kv.KVCacheError, RuntimeError)


def test_unused_token_lets_xla_drop_a_pure_write_but_not_a_side_effecting_one(pool):
    c = make_cache(pool)
    ids = c.alloc(1)
    s = jnp.asarray(c.slot_mapping(ids, np.arange(1)))
    k = jnp.ones((1, 2, 64))

    def dropped(c, k, s):
        ops.write_kv(c, 0, k, k, s, ops.new_token())
        return k.sum()

    def kept(c, k, s):
        ops.write_kv(c, 0, k, k, s, ops.new_token(), side_effect=True)
        return k.sum()

    assert "kvcached_write_kv" not in jax.jit(dropped).lower(c, k, s).compile().as_text()
    jax.jit(kept)(c, k, s).block_until_ready()
    assert float(c.view[0, 0, ids[0], 0].sum()) == 2 * 64


def test_write_kv_many_layers_in_one_call(pool):
    c = make_cache(pool, layers=4)
    ids = c.alloc(2)
    slots = jnp.asarray(c.slot_mapping(ids, np.arange(20)))
    k = _rand((3, 20, 2, 64), "float32", 5)
    v = _rand((3, 20, 2, 64), "float32", 6)
    ops.write_kv(c, 1, k, v, slots, ops.new_token()).block_until_ready()
    blocks, offs = np.asarray(slots) // 16, np.asarray(slots) % 16
    view = np.asarray(c.view)
    np.testing.assert_array_equal(view[1:4, 0][:, blocks, offs], np.asarray(k))
    np.testing.assert_array_equal(view[1:4, 1][:, blocks, offs], np.asarray(v))
    assert np.abs(view[0]).sum() == 0.0
    with pytest.raises(FFI_ERRORS, match="out of range"):
        _run(lambda: ops.write_kv(c, 2, k, v, slots, ops.new_token()))  # layers 2..4 > 3
    with pytest.raises(ValueError, match="differ"):
        ops.write_kv(c, 0, k, v[:2], slots, ops.new_token())


def test_write_kv_async_writes_like_write_kv_and_validates(pool):
    """The step loop's write (layer an int or an int32 operand). On the host backend the handler
    validates at once, as write_kv; the device page map follows every map and unmap."""
    a, b = make_cache(pool, layers=3), make_cache(pool, name="b", layers=3)
    ids_a, ids_b = a.alloc(2), b.alloc(2)
    slots = a.slot_mapping(ids_a, np.arange(20))
    k = _rand((2, 20, 2, 64), "float32", 3)
    ops.write_kv(a, 1, k, -k, jnp.asarray(slots), ops.new_token()).block_until_ready()
    ops.write_kv_async(b, 1, k, -k, jnp.asarray(slots), ops.new_token()).block_until_ready()
    np.testing.assert_array_equal(np.asarray(a.view), np.asarray(b.view))
    # The layer as an operand: traced (a scanned model's loop index) writes the same.
    traced = jax.jit(lambda i, k, v, s, t, c: ops.write_kv_async(c, i, k, v, s, t))
    traced(jnp.int32(1), k[1], k[0], jnp.asarray(slots), ops.new_token(), b).block_until_ready()
    view = np.asarray(b.view)
    blocks, offs = slots // 16, slots % 16
    np.testing.assert_array_equal(view[1, 0][blocks, offs], np.asarray(k[1]))
    np.testing.assert_array_equal(view[1, 1][blocks, offs], np.asarray(k[0]))
    with pytest.raises(FFI_ERRORS, match="layer 3 out of range"):
        _run(lambda: traced(jnp.int32(3), k[0], k[0], jnp.asarray(slots), ops.new_token(), b))
    with pytest.raises(FFI_ERRORS, match="layer -1 out of range"):
        _run(lambda: traced(jnp.int32(-1), k[0], k[0], jnp.asarray(slots), ops.new_token(), b))
    with pytest.raises(TypeError, match="layer must be int32"):
        ops.write_kv_async(b, jnp.int16(0), k[0], k[0], jnp.asarray(slots), ops.new_token())
    with pytest.raises(TypeError, match="layer must be an int"):
        ops.write_kv_async(b, True, k[0], k[0], jnp.asarray(slots), ops.new_token())
    with pytest.raises(TypeError, match="layer must be an int"):
        ops.write_kv_async(b, jnp.zeros(2, jnp.int32), k[0], k[0], jnp.asarray(slots),
                           ops.new_token())  # fmt: skip
    with pytest.raises(ValueError, match="layer 2 \\(\\+2 layers\\) out of range"):
        ops.write_kv_async(b, 2, k, k, jnp.asarray(slots), ops.new_token())
    page = next(p for p in range(1, 99) if p not in b.mapped_page_ids())
    bad = jnp.asarray([b.page_blocks(page)[0] * 16], jnp.int32)
    with pytest.raises(FFI_ERRORS, match="unmapped page"):
        _run(lambda: ops.write_kv_async(b, 0, k[0, :1], k[0, :1], bad, ops.new_token()))
    assert b.take_device_error() == (0, 0)
    ops.raise_device_errors(b)  # nothing recorded: no error
    page_map = b.device_page_map()
    assert [p for p, m in enumerate(page_map) if m] == list(b.mapped_page_ids())
    b.free(ids_b)
    assert not any(b.device_page_map())
    with pytest.raises(ValueError, match="block 1 of 'b' is not allocated"):
        b.check_writable([1])
    a.free(ids_a)


def test_a_view_closed_over_in_jit_is_refused_at_trace_time(pool):
    """A jitted function that closes over the cache would read a constant snapshot of its
    buffer: every op refuses it, naming the fix; passed as an argument it runs."""
    c = make_cache(pool)
    ids = c.alloc(1)
    s = jnp.asarray(c.slot_mapping(ids, np.arange(2)))
    k = jnp.ones((2, 2, 64))
    closures = [
        lambda k, s, t: ops.write_kv(c, 0, k, k, s, t),
        lambda k, s, t: ops.write_kv_async(c, 0, k, k, s, t),
        lambda k, s, t: ops.copy_blocks(c, s[:1] // 16, s[:1] // 16 + 1, t),
        lambda k, s, t: ops.map_pages(c, s[:1] * 0 + 7, t),
        lambda k, s, t: ops.unmap_pages(c, s[:1] * 0 + 7, t),
        lambda k, s, t: ops.paged_attention(c, 0, k[:, :, None], (s // 16)[None], s[:1] + 1,
                                            s[:1] * 0, s[:1] * 0 + 1, t),  # fmt: skip
    ]
    for fn in closures:
        with pytest.raises(ValueError, match="pass the cache to the function as an argument"):
            jax.jit(fn)(k, s, ops.new_token())
    arg = jax.jit(lambda c, k, s, t: ops.write_kv(c, 0, k, k, s, t))(c, k, s, ops.new_token())
    arg.block_until_ready()
    assert float(c.view[0, 0, ids[0], :2].sum()) == 2 * 2 * 64
