"""KV cache groups in the memory layer: per-group block ids over the group's planes, one
ledger for the tenant, exact accounting, per-layer device page maps, clear refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached.memory import ops
from jax_kvcached.memory.host_store import HostStore

PAGE = 65536


@pytest.fixture
def pool():
    p = kv.Pool(48 * PAGE, page_size=PAGE, backend="host")
    yield p
    p.close()


def _cache(pool, groups=(0, 1, 0, 0)):
    # 2 KV heads x 64 x f32 x 16 tokens = 8 KiB blocks: 8 per page.
    return pool.create_kv_cache("m", len(groups), 2, 64, "float32", 16, layer_groups=groups)


def test_groups_map_only_their_layers_planes(pool):
    cache = _cache(pool)
    g0, g1 = cache.groups
    # Each group describes its planes per layer: K and V of (block, heads, dim) here.
    for g in (g0, g1):
        assert [(p.name, p.block_shape, p.block_bytes) for p in g.planes] == [
            ("k", (16, 2, 64), 8192), ("v", (16, 2, 64), 8192)]  # fmt: skip
        assert g.pages_per_kv_page == len(g.planes) * len(g.layers)
    assert cache.stats()["groups"][1]["planes"] == {"k": [16, 2, 64], "v": [16, 2, 64]}
    assert (g0.layers, g1.layers) == ((0, 2, 3), (1,))
    assert (g0.pages_per_kv_page, g1.pages_per_kv_page) == (6, 2)
    a = g0.alloc(3)
    assert cache.mapped_pages == 6 and pool.stats()["mapped_pages"] == 6
    b = g1.alloc(9)  # 9 blocks: two KV pages of group 1 (page 0 holds 7 usable)
    assert g1.num_mapped_pages == 2 and cache.mapped_pages == 6 + 4
    assert pool.stats()["mapped_pages"] == 10
    # The device page maps are per layer: each layer sees its own group's pages.
    assert cache.device_page_map(0)[:2] == [1, 0]
    assert cache.device_page_map(1)[:2] == [1, 1]
    assert cache.device_page_map(3)[:2] == [1, 0]
    # Writes land in the layer's group: block ids mean different memory per group.
    k = jnp.full((1, 2, 64), 7.0)
    slot = int(a[0]) * 16

    @jax.jit
    def write(cache, layer, k, slots, token):
        return ops.write_kv(cache, layer, k, k, slots, token)

    jax.block_until_ready(write(cache, 0, k, jnp.array([slot], jnp.int32), ops.new_token()))
    jax.block_until_ready(write(cache, 1, 2 * k, jnp.array([slot], jnp.int32), ops.new_token()))
    view = np.asarray(cache.view)
    assert view[0, 0, a[0], 0, 0, 0] == 7.0 and view[1, 0, a[0], 0, 0, 0] == 14.0
    assert view[2, 0, a[0], 0, 0, 0] == 0.0  # layer 2 (group 0) was not written
    g1.free(b)
    assert g1.num_mapped_pages == 0 and cache.mapped_pages == 6
    g0.free(a)
    assert cache.mapped_pages == 0 and pool.stats()["mapped_pages"] == 0


def test_a_write_into_a_page_its_group_has_not_mapped_is_refused(pool):
    cache = _cache(pool)
    a = cache.groups[0].alloc(1)  # page 0 of group 0 only
    slots = jnp.array([int(a[0]) * 16], jnp.int32)
    k = jnp.ones((1, 2, 64))
    with pytest.raises(Exception, match="unmapped page 0 of group 1"):
        jax.block_until_ready(ops.write_kv(cache, 1, k, k, slots, ops.new_token()))
    # A multi-layer write across groups is refused too (the groups' slots differ).
    k4 = jnp.ones((2, 1, 2, 64))
    with pytest.raises(Exception, match="span several KV cache groups"):
        jax.block_until_ready(ops.write_kv(cache, 0, k4, k4, slots, ops.new_token()))


def test_block_calls_on_a_multi_group_cache_name_the_groups(pool):
    cache = _cache(pool)
    with pytest.raises(kv.KVCacheError, match="2 KV cache groups"):
        cache.alloc(1)
    with pytest.raises(ValueError, match="every group id"):
        pool.create_kv_cache("bad", 3, 2, 64, "float32", layer_groups=(0, 2, 2))
    with pytest.raises(ValueError, match="entries for 3 layers"):
        pool.create_kv_cache("bad", 3, 2, 64, "float32", layer_groups=(0, 1))
    a = cache.groups[0].alloc(2)
    with pytest.raises(ValueError, match="group 2 out of range"):
        ops.copy_blocks(cache, a[:1], a[1:], ops.new_token(), group=2)


def test_a_block_copy_moves_only_its_groups_planes(pool):
    """copy_blocks(group=g) copies block ids of group g in g's layers' K and V planes and
    leaves the other group's same block ids alone; blocks the group has not mapped are
    refused."""
    cache = _cache(pool)  # layers 0, 2, 3 in group 0; layer 1 in group 1
    g0, g1 = cache.groups
    a, b = g0.alloc(2), g1.alloc(2)
    assert a.tolist() == b.tolist()  # the same ids, different memory
    rng = np.random.default_rng(0)
    for layer, blocks in ((0, a), (1, b), (2, a), (3, a)):
        slots = jnp.asarray(np.arange(16) + int(blocks[0]) * 16, jnp.int32)
        k = jnp.asarray(rng.standard_normal((16, 2, 64)), jnp.float32)
        jax.block_until_ready(ops.write_kv(cache, layer, k, -k, slots, ops.new_token()))
    before = np.asarray(cache.view).copy()
    jax.block_until_ready(ops.copy_blocks(cache, b[:1], b[1:], ops.new_token(), group=1))
    after = np.asarray(cache.view)
    np.testing.assert_array_equal(after[1, :, b[1]], before[1, :, b[0]])  # group 1's layer
    for layer in (0, 2, 3):  # group 0's block b[1] (== a[1]) untouched
        np.testing.assert_array_equal(after[layer, :, a[1]], before[layer, :, a[1]])
    jax.block_until_ready(ops.copy_blocks(cache, a[:1], a[1:], ops.new_token(), group=0))
    after = np.asarray(cache.view)
    for layer in (0, 2, 3):
        np.testing.assert_array_equal(after[layer, :, a[1]], before[layer, :, a[0]])
    unmapped = g1.blocks_per_page * 3  # a block on a page group 1 never mapped
    with pytest.raises(Exception, match="unmapped page"):
        jax.block_until_ready(
            ops.copy_blocks(cache, b[:1], jnp.asarray([unmapped]), ops.new_token(), group=1)
        )


def test_groups_share_one_budget(pool):
    cache = _cache(pool)  # budget 48 pages: group 0 costs 6 a KV page, group 1 costs 2
    g0, g1 = cache.groups
    got0 = g0.alloc(g0.num_free_blocks)
    assert cache.mapped_pages == 48 and g1.num_free_blocks == 0
    with pytest.raises(kv.PoolExhausted):
        g1.alloc(1)
    g0.free(got0[: len(got0) // 2])
    assert g1.num_free_blocks > 0
    assert cache.stats()["groups"][0]["mapped_pages"] == g0.mapped_pages
    assert cache.mapped_pages == g0.mapped_pages + g1.mapped_pages


def test_the_host_tier_copies_a_groups_own_planes(pool):
    """A host store per group: a slot holds the group's layers' planes only, round trips
    are byte-identical through an unmap, and a block of another group's page is refused."""
    cache = _cache(pool)
    g0, g1 = cache.groups
    s0, s1 = HostStore(cache, 4, 0), HostStore(cache, 4, 1)
    assert (s0.slot_bytes, s1.slot_bytes) == (6 * cache.block_bytes, 2 * cache.block_bytes)
    assert s0.total_bytes + s1.total_bytes == 4 * 2 * 4 * cache.block_bytes  # 4 slots x 4 layers
    a, b = g0.alloc(2).tolist(), g1.alloc(2).tolist()
    planes = {0: (0, 2, 3), 1: (1,)}
    rng = np.random.default_rng(0)

    @jax.jit
    def write(cache, layer, k, v, slots, token):
        return ops.write_kv(cache, layer, k, v, slots, token)

    for group, blocks in ((0, a), (1, b)):
        slots = jnp.asarray([x * 16 + t for x in blocks for t in range(16)], jnp.int32)
        for layer in planes[group]:
            k, v = (jnp.asarray(rng.standard_normal((32, 2, 64)), jnp.float32) for _ in "kv")
            jax.block_until_ready(write(cache, layer, k, v, slots, ops.new_token()))
    before = np.asarray(cache.view).copy()

    def group_bytes(view, group, block):
        return b"".join(view[layer, :, block].tobytes() for layer in planes[group])

    for store, group, blocks in ((s0, 0, a), (s1, 1, b)):
        assert store.done(store.copy_out(blocks, [0, 1]))
        assert store.read_slot(1) == group_bytes(before, group, blocks[1])
    g0.free(a)
    g1.free(b)
    assert cache.mapped_pages == 0
    # Group 1's blocks come back elsewhere (group 0 holds page 0 now): same bytes.
    g0.alloc(8)
    b2 = g1.alloc(10).tolist()[8:]
    ahead = np.asarray(cache.view).copy()
    s1.copy_in([0, 1], b2)
    after = np.asarray(cache.view)
    for old, new in zip(b, b2, strict=True):
        assert group_bytes(after, 1, new) == group_bytes(before, 1, old)
        assert group_bytes(after, 0, new) == group_bytes(ahead, 0, new)  # other planes: as were
    with pytest.raises(kv.KVCacheError, match="unmapped page"):  # a page group 0 has not mapped
        cache.shards[0].copy_to_host(np.array([20], np.int32), np.array([2], np.int64),
                                     s0.arenas[0])  # fmt: skip
    with pytest.raises(ValueError, match="not allocated"):
        s0.copy_out([b2[0]], [2])  # allocated in group 1, not in group 0
    with pytest.raises(ValueError, match="group 2 out of range"):
        HostStore(cache, 4, 2)
